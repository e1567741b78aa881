"""RNG state: capture every generator, save it, restore it exactly; isolate a block.

Invariants:
- ``RngState.capture`` reads Python ``random``, NumPy's global RNG (when NumPy is installed),
  torch CPU, every CUDA device *already initialised* and the generator objects passed by name.
  It never initialises CUDA: in a process where CUDA has not started there is no CUDA state to
  save (the devices start from their seed when CUDA starts).
- ``to_dict`` holds only tensors, ints, floats, strings, lists and dicts, so
  ``torch.save`` + ``torch.load(weights_only=True)`` (and, tensors aside, JSON) round-trip it.
- ``from_dict`` validates everything before anything is restored, and ``restore`` checks the
  generator objects before it changes any state: a bad state never leaves a half-restored process.
- ``fork_rng`` restores every stream it covers on exit, whatever the block did.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrepro import _runtime
from torchrepro._compat import numpy_or_none
from torchrepro.errors import ReproWarning, RngStateError, warn_once
from torchrepro.seeding import seed_streams, validate_seed

__all__ = ["RNG_STATE_VERSION", "RngState", "fork_rng"]

RNG_STATE_VERSION = 1
"""Version of the ``RngState.to_dict`` layout; ``from_dict`` refuses versions it does not know."""

_KEYS_REQUIRED = ("version", "python", "torch", "cuda", "generators")
_KEYS_OPTIONAL = ("numpy",)
_ARRAY_TAG = "__ndarray__"
_GENERATOR_KINDS = ("torch", "numpy", "numpy_random_state")


@dataclass(frozen=True, eq=False)
class _GeneratorState:
    kind: str  # one of _GENERATOR_KINDS
    state: Any  # torch: uint8 tensor; numpy: the state dict numpy returns
    device: str = "cpu"  # torch generators only


def _generator_kind(name: str, gen: object) -> str:
    if isinstance(gen, torch.Generator):
        return "torch"
    np = numpy_or_none()
    if np is not None:
        if isinstance(gen, np.random.Generator):
            return "numpy"
        if isinstance(gen, np.random.RandomState):
            return "numpy_random_state"
    raise TypeError(
        f"generator {name!r} is a {type(gen).__name__}; expected torch.Generator, "
        "numpy.random.Generator or numpy.random.RandomState. Pass generator objects, not seeds."
    )


def _check_generator_mapping(generators: object) -> Mapping[str, Any]:
    if generators is None:
        return {}
    if not isinstance(generators, Mapping):
        raise TypeError(
            f"generators must be a mapping of name -> generator, got {type(generators).__name__}; "
            "pass e.g. generators={'augment': gen}."
        )
    for name, gen in generators.items():
        if not isinstance(name, str):
            raise TypeError(f"generator names must be str, got {type(name).__name__} {name!r}.")
        _generator_kind(name, gen)
    return generators


def _capture_generator(name: str, gen: Any) -> _GeneratorState:
    kind = _generator_kind(name, gen)
    if kind == "torch":
        return _GeneratorState("torch", gen.get_state(), str(gen.device))
    if kind == "numpy":
        return _GeneratorState("numpy", gen.bit_generator.state)
    return _GeneratorState("numpy_random_state", gen.get_state(legacy=False))


# --- plain-data encoding of NumPy states (arrays become tagged lists of ints) ---


def _encode_np(value: Any) -> Any:
    np = numpy_or_none()
    if isinstance(value, dict):
        return {str(k): _encode_np(v) for k, v in value.items()}
    if np is not None and isinstance(value, np.ndarray):
        return {_ARRAY_TAG: str(value.dtype), "values": value.tolist()}
    if np is not None and isinstance(value, np.generic):
        return value.item()
    return value


def _decode_np(value: Any, np: Any) -> Any:
    if isinstance(value, dict):
        if _ARRAY_TAG in value:
            return np.asarray(value["values"], dtype=value[_ARRAY_TAG])
        return {k: _decode_np(v, np) for k, v in value.items()}
    return value


def _fail(where: str, problem: str) -> RngStateError:
    return RngStateError(
        f"Invalid RNG state: {where}: {problem}. Pass a dict made by RngState.to_dict() "
        "(saved with torch.save and loaded with torch.load(weights_only=True))."
    )


def _check_byte_tensor(where: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        got = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise _fail(where, f"expected a 1-D torch.uint8 tensor, got {got}")
    return value.detach().to("cpu").clone()


def _check_cpu_torch_state(where: str, value: object) -> torch.Tensor:
    state = _check_byte_tensor(where, value)
    try:
        torch.Generator().set_state(state)  # validates the size without touching any real stream
    except (RuntimeError, TypeError) as exc:
        raise _fail(where, str(exc).splitlines()[0]) from None
    return state


def _check_python_state(value: object) -> tuple[Any, ...]:
    if not isinstance(value, Mapping) or set(value) != {"version", "state", "gauss_next"}:
        raise _fail("'python'", "expected a dict with keys 'version', 'state', 'gauss_next'")
    state, gauss = value["state"], value["gauss_next"]
    if not isinstance(state, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in state
    ):
        raise _fail("'python'['state']", "expected a list of ints")
    if not isinstance(gauss, (list, tuple)) or len(gauss) > 1:
        raise _fail("'python'['gauss_next']", "expected [] or [float]")
    result = (value["version"], tuple(state), float(gauss[0]) if gauss else None)
    try:
        random.Random().setstate(result)  # validates without touching the global stream
    except (ValueError, TypeError, OverflowError) as exc:
        raise _fail("'python'", str(exc)) from None
    return result


def _check_numpy_state(where: str, kind: str, value: object, np: Any) -> Any:
    if not isinstance(value, Mapping):
        raise _fail(where, f"expected a dict, got {type(value).__name__}")
    decoded = _decode_np(dict(value), np)
    try:
        if kind == "numpy":
            name = decoded.get("bit_generator")
            bit_generator = getattr(np.random, str(name), None)
            if not (isinstance(bit_generator, type) and issubclass(bit_generator, np.random.BitGenerator)):
                raise _fail(where, f"unknown NumPy bit generator {name!r}")
            bit_generator().state = decoded
        else:
            np.random.RandomState().set_state(decoded)
    except (ValueError, TypeError, KeyError) as exc:
        raise _fail(where, f"NumPy rejected it ({exc})") from None
    return decoded


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True, eq=False)
class RngState:
    """A snapshot of every RNG stream a training step may draw from.

    Holds Python ``random``, NumPy's global RNG (``None`` when NumPy is not installed), the torch
    CPU generator, one state per *initialised* CUDA device and the generator objects captured by
    name. Capturing never initialises CUDA.

    >>> state = RngState.capture()
    >>> a = torch.rand(2)
    >>> state.restore()
    >>> torch.equal(a, torch.rand(2))
    True
    """

    python: tuple[Any, ...]
    numpy: Mapping[str, Any] | None
    torch_cpu: torch.Tensor
    cuda: Mapping[int, torch.Tensor] = field(default_factory=dict)
    generators: Mapping[str, _GeneratorState] = field(default_factory=dict)

    @classmethod
    def capture(cls, *, generators: Mapping[str, Any] | None = None) -> RngState:
        """Capture the global streams and the generator objects in ``generators`` (by name).

        ``generators`` maps a name to a ``torch.Generator``, ``numpy.random.Generator`` or
        ``numpy.random.RandomState``; pass the same names to ``restore``.
        """
        gens = _check_generator_mapping(generators)
        np = numpy_or_none()
        cuda: dict[int, torch.Tensor] = {}
        if _runtime.cuda_started():  # never start CUDA just to read its state
            cuda = {i: torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())}
        return cls(
            python=random.getstate(),
            numpy=np.random.get_state(legacy=False) if np is not None else None,
            torch_cpu=torch.get_rng_state(),
            cuda=cuda,
            generators={name: _capture_generator(name, gen) for name, gen in gens.items()},
        )

    def restore(self, *, generators: Mapping[str, Any] | None = None) -> None:
        """Restore the global streams and, in place, the generator objects passed by name.

        Each object in ``generators`` must have been captured under the same name and be of the
        same kind (and device type); names captured but not passed are left alone. CUDA states
        are applied lazily when CUDA has not started yet (restoring never initialises CUDA).
        """
        gens = _check_generator_mapping(generators)
        for name, gen in gens.items():  # check everything before changing anything
            self._check_target(name, gen)
        _check_device_count(self.cuda)
        random.setstate(self.python)
        np = numpy_or_none()
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        for index, state in self.cuda.items():
            torch.cuda.set_rng_state(state, index)  # applied lazily if CUDA has not started
        for name, gen in gens.items():
            saved = self.generators[name]
            if saved.kind == "torch":
                gen.set_state(saved.state)
            elif saved.kind == "numpy":
                gen.bit_generator.state = saved.state
            else:
                gen.set_state(saved.state)

    def _check_target(self, name: str, gen: Any) -> None:
        if name not in self.generators:
            raise RngStateError(
                f"No RNG state for generator {name!r}: this state holds {sorted(self.generators)}. "
                f"Capture it with RngState.capture(generators={{{name!r}: gen}})."
            )
        saved = self.generators[name]
        kind = _generator_kind(name, gen)
        if kind != saved.kind:
            raise RngStateError(
                f"Generator {name!r} was captured as a {saved.kind} generator but a {kind} generator "
                "was passed to restore it; pass the same kind of object under that name."
            )
        if kind == "torch" and torch.device(saved.device).type != gen.device.type:
            raise RngStateError(
                f"Generator {name!r} was captured on {saved.device} but the generator passed lives "
                f"on {gen.device}; pass a generator on {torch.device(saved.device).type}."
            )
        if kind == "numpy" and saved.state.get("bit_generator") != type(gen.bit_generator).__name__:
            raise RngStateError(
                f"Generator {name!r} was captured with bit generator {saved.state.get('bit_generator')} "
                f"but the one passed uses {type(gen.bit_generator).__name__}; create it with "
                f"numpy.random.Generator(numpy.random.{saved.state.get('bit_generator')}())."
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (tensors, numbers, strings, lists, dicts): ``torch.load(weights_only=True)`` safe."""
        version, internal, gauss = self.python
        out: dict[str, Any] = {
            "version": RNG_STATE_VERSION,
            "python": {
                "version": version,
                "state": list(internal),
                "gauss_next": [] if gauss is None else [gauss],
            },
            "torch": self.torch_cpu.clone(),
            "cuda": {str(i): s.clone() for i, s in self.cuda.items()},
            "generators": {},
        }
        if self.numpy is not None:
            out["numpy"] = _encode_np(self.numpy)
        for name, saved in self.generators.items():
            entry: dict[str, Any] = {"kind": saved.kind}
            if saved.kind == "torch":
                entry["device"] = saved.device
                entry["state"] = saved.state.clone()
            else:
                entry["state"] = _encode_np(saved.state)
            out["generators"][name] = entry
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, devices: Sequence[int] | None = None) -> RngState:
        """Rebuild a state made by ``to_dict``; validate everything, raise ``RngStateError``.

        ``devices`` picks which captured CUDA device states to keep (by index); by default all
        are kept, and a state with more CUDA devices than this process has is refused.
        """
        if not isinstance(d, Mapping):
            raise _fail("top level", f"expected a dict, got {type(d).__name__}")
        missing = [k for k in _KEYS_REQUIRED if k not in d]
        unknown = sorted(str(k) for k in d if k not in _KEYS_REQUIRED + _KEYS_OPTIONAL)
        if "version" in d and d["version"] != RNG_STATE_VERSION:
            version = d["version"]
            if isinstance(version, int) and not isinstance(version, bool) and version > RNG_STATE_VERSION:
                raise RngStateError(
                    f"RNG state version {version} is newer than this torchrepro reads "
                    f"(version {RNG_STATE_VERSION}); upgrade torchrepro to load it."
                )
            raise _fail("'version'", f"expected {RNG_STATE_VERSION}, got {version!r}")
        if missing or unknown:
            problems = []
            if missing:
                problems.append(f"missing keys {missing}")
            if unknown:
                problems.append(f"unknown keys {unknown}")
            raise _fail("top level", " and ".join(problems))
        python = _check_python_state(d["python"])
        torch_state = _check_cpu_torch_state("'torch'", d["torch"])
        cuda = _cuda_from_dict(d["cuda"], devices)
        np = numpy_or_none()
        numpy_state = None
        if "numpy" in d and np is not None:  # without NumPy nothing can draw from its global RNG
            numpy_state = _check_numpy_state("'numpy'", "numpy_random_state", d["numpy"], np)
        gens_in = d["generators"]
        if not isinstance(gens_in, Mapping):
            raise _fail("'generators'", f"expected a dict, got {type(gens_in).__name__}")
        gens = {name: _generator_from_dict(str(name), entry) for name, entry in gens_in.items()}
        return cls(python=python, numpy=numpy_state, torch_cpu=torch_state, cuda=cuda, generators=gens)


def _check_device_count(cuda: Mapping[int, torch.Tensor]) -> None:
    if not cuda:
        return
    available = _cuda_device_count()
    if max(cuda) >= available:
        keep = [i for i in sorted(cuda) if i < available]
        raise RngStateError(
            f"Cannot restore RNG state captured on {len(cuda)} CUDA devices into a process with "
            f"{available}; pass devices={keep} to RngState.from_dict to restore a subset"
            + (" (devices=[] keeps only the CPU streams)." if keep else ".")
        )


def _cuda_from_dict(value: object, devices: Sequence[int] | None) -> dict[int, torch.Tensor]:
    if not isinstance(value, Mapping):
        raise _fail("'cuda'", f"expected a dict of device index -> tensor, got {type(value).__name__}")
    cuda: dict[int, torch.Tensor] = {}
    for key, state in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise _fail("'cuda'", f"device keys must be index strings like '0', got {key!r}")
        cuda[int(key)] = _check_byte_tensor(f"'cuda'[{key!r}]", state)
    if devices is not None:
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
            raise TypeError(f"devices must be a list of CUDA device indices, got {type(devices).__name__}.")
        for i in devices:
            if isinstance(i, bool) or not isinstance(i, int) or i not in cuda:
                raise ValueError(f"devices must list captured CUDA device indices {sorted(cuda)}, got {i!r}.")
        cuda = {i: cuda[i] for i in sorted(set(devices))}
    _check_device_count(cuda)
    return cuda


def _generator_from_dict(name: str, entry: object) -> _GeneratorState:
    where = f"'generators'[{name!r}]"
    if not isinstance(entry, Mapping) or entry.get("kind") not in _GENERATOR_KINDS:
        raise _fail(where, f"expected a dict with 'kind' one of {list(_GENERATOR_KINDS)}")
    kind = entry["kind"]
    if kind == "torch":
        device = entry.get("device")
        try:
            dev = torch.device(device)  # type: ignore[arg-type]
        except (RuntimeError, TypeError):
            raise _fail(where, f"bad device {device!r}") from None
        if dev.type == "cpu":
            state = _check_cpu_torch_state(where, entry.get("state"))
        else:
            state = _check_byte_tensor(where, entry.get("state"))
        return _GeneratorState("torch", state, str(dev))
    np = numpy_or_none()
    if np is None:
        raise RngStateError(
            f"RNG state for generator {name!r} is a NumPy state but NumPy is not installed; "
            "install it with `pip install numpy`."
        )
    return _GeneratorState(kind, _check_numpy_state(where, kind, entry.get("state"), np))


@contextmanager
def isolated(generators: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Restore every stream on exit; undo CUDA seeds queued or drawn while CUDA was not started.

    When CUDA has not started, its generators have no state yet, only a pending seed (the last
    ``torch.manual_seed``, which is ``torch.initial_seed()``). If the block seeded torch or
    started CUDA, that pending seed is put back on exit.
    """
    cuda_started = _runtime.cuda_started()
    pending_cuda_seed = torch.initial_seed()
    state = RngState.capture(generators=generators)
    try:
        yield
    finally:
        reseeded = torch.initial_seed() != pending_cuda_seed
        state.restore(generators=generators)
        if not cuda_started and _runtime.cuda_started():
            warn_once(
                "rng-cuda-started-inside",
                "CUDA was initialised inside a torchrepro RNG block, so its streams were reset to "
                "their seed on exit, not to where they were; initialise CUDA before the block "
                "(e.g. torch.cuda.init()) to restore them exactly.",
                ReproWarning,
                stacklevel=4,
            )
            torch.cuda.manual_seed_all(pending_cuda_seed)
        elif not cuda_started and reseeded:
            torch.cuda.manual_seed_all(pending_cuda_seed)  # replaces the seed queued inside the block


@contextmanager
def fork_rng(
    seed: int | None = None, *, enabled: bool = True, generators: Mapping[str, Any] | None = None
) -> Iterator[None]:
    """Isolate every RNG for the block: Python, NumPy, torch CPU and CUDA (plus ``generators``).

    With ``seed``, the block starts from the same streams as after ``seed_everything(seed)``.
    On exit every stream is as it was before. ``enabled=False`` makes it a no-op.

    >>> with fork_rng(0):
    ...     inside = torch.rand(1)
    >>> with fork_rng(0):
    ...     torch.equal(inside, torch.rand(1))
    True
    """
    if seed is not None:
        seed = validate_seed(seed)
    if not enabled:
        yield
        return
    with isolated(generators):
        if seed is not None:
            seed_streams(seed, idle_cuda=False)
        yield
