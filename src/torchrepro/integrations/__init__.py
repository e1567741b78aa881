"""Integrations with training frameworks, one module each, importing the framework only there.

- ``torchrepro.integrations.lightning``: ``TorchreproCallback``, a Lightning ``Callback``.
- ``torchrepro.integrations.transformers``: ``TorchreproTrainerMixin`` and ``TorchreproTrainer``
  for the Hugging Face ``Trainer``.

``import torchrepro`` (and this package) imports no framework; a module here raises a
``ModuleNotFoundError`` naming the extra to install when its framework is missing.
"""
