"""Op-level tracing: which aten op, module and source line made two runs part.

Invariants:
- This package is the only place that touches torch's dispatch internals (``TorchDispatchMode``,
  the autograd node being executed, node metadata) and Inductor's (``compile_fx``, Dynamo's
  graphs). Nothing else in torchrepro imports them.
- Every aten op of forward and backward is attributed to a module path (dotted, without the root's
  name: ``layer2.drop``; an op in the root's own ``forward`` gets the root's class name) and to a
  ``file:line`` of user code: the first frame outside torch, torchrepro and the standard library,
  relative to the current directory when below it. A backward op of a built-in function gets the
  module and line of the forward op that created its autograd node; a backward op issued by user
  code that runs inside backward (a custom ``autograd.Function.backward``, a hook, a checkpoint
  recomputation) gets that user line.
- A trace digests the inputs and outputs of every op exactly (every byte); contents of
  uninitialised memory (``empty``, ``empty_like``, ... and whatever is computed from it before it
  is overwritten) are never digested as data. In-place and ``out=`` writes, and the hidden running
  statistics update of batch norm, are digested after the op as outputs.
- Trace files are JSON, written atomically; recording changes no numerics and no RNG state.
- One module per job: ``ops`` (plain data of op events and trace files, no torch), ``sites``
  (attribution), ``dispatch`` (the dispatch mode and the observer base), ``oprecorder``
  (``OpRecorder``: op names for the audit, no digests), ``tracer`` (digests,
  ``Tracer``, ``trace``), ``capture`` (one op call's inputs saved, in the child), ``repro``
  (``check --repro``: the standalone script, no torch), ``compare`` (reading and comparing trace
  files, no torch), ``compiled`` (``check --vary compile``: compiled graph calls against eager runs
  of the same graphs, where op tracing cannot see; its reader imports no torch). Submodules load
  lazily on first use of a public name: importing this package imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.tracing.compare import compare_traces
    from torchrepro.tracing.oprecorder import OpRecorder
    from torchrepro.tracing.ops import OpDivergence, OpEvent
    from torchrepro.tracing.tracer import Tracer, trace

__all__ = ["OpDivergence", "OpEvent", "OpRecorder", "Tracer", "compare_traces", "trace"]

_SUBMODULES: dict[str, str] = {
    "OpDivergence": "ops",
    "OpEvent": "ops",
    "OpRecorder": "oprecorder",
    "Tracer": "tracer",
    "compare_traces": "compare",
    "trace": "tracer",
}


__getattr__, __dir__ = lazy_exports(__name__, _SUBMODULES, __all__)
