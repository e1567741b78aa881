"""fingerprint(): equal values give equal digests in any layout and process; any change is seen."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
from collections import OrderedDict, namedtuple
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrepro import fingerprint

# The module that holds ``torchrepro.fingerprint`` and its helpers.
fp_mod = importlib.import_module("torchrepro.hashing")

MASK64 = (1 << 64) - 1

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    *[getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n)],
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype`` (so every bit pattern, NaNs included, can occur)."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, int(np.prod(shape))) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype)[: int(np.prod(shape))].reshape(shape)


def flip_bit(t: torch.Tensor, bit: int) -> torch.Tensor:
    out = t.clone().contiguous()
    raw = out.reshape(-1).view(torch.uint8)
    if t.dtype == torch.bool:  # only 0/1 are valid bools: flip the value
        raw[bit // 8 % raw.numel()] ^= 1
    else:
        raw[bit // 8 % raw.numel()] ^= 1 << (bit % 8)
    return out


@pytest.fixture(params=["small", "words"])
def path(request: pytest.FixtureRequest) -> Any:
    """Run a test on the hashlib fast path and on the device word path (forced for small tensors)."""
    limit = fp_mod.SMALL_TENSOR_BYTES if request.param == "small" else -1
    with (
        mock.patch.object(fp_mod, "SMALL_TENSOR_BYTES", limit),
        mock.patch.object(fp_mod, "_CPU_CHUNK_WORDS", 7),
    ):
        yield request.param


# --- tensors ---------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_equal_values_equal_digest_and_a_flipped_bit_differs(
    dtype: torch.dtype, path: str
) -> None:
    t = random_tensor((5, 7), dtype, seed=1)
    digest = fingerprint(t)
    assert len(digest) == 32 and int(digest, 16) >= 0
    assert fingerprint(t.clone()) == digest
    assert fingerprint(t.t().contiguous().t()) == digest  # other strides, same values
    for bit in (0, 7, 13 * 8 + 3, t.numel() * t.element_size() * 8 - 1):
        assert fingerprint(flip_bit(t, bit)) != digest, bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16], ids=str)
def test_dtype_and_shape_are_part_of_the_digest(dtype: torch.dtype, path: str) -> None:
    t = random_tensor((4, 6), dtype, seed=2)
    digest = fingerprint(t)
    assert fingerprint(t.reshape(6, 4)) != digest
    assert fingerprint(t.reshape(24)) != digest
    assert fingerprint(t.reshape(1, 4, 6)) != digest
    same_bytes = t.view(torch.uint8) if dtype != torch.uint8 else t.view(torch.int8)
    assert fingerprint(same_bytes) != digest
    assert fingerprint(torch.zeros(0, dtype=dtype)) != fingerprint(torch.zeros(0, 3, dtype=dtype))


def test_word_path_is_the_documented_function() -> None:
    """Recompute the device path in pure Python (64-bit wrapping ints) and compare the lanes."""
    t = random_tensor((9000 * 8 + 5,), torch.uint8, seed=3)  # above the fast-path size, odd tail
    data = bytes(t.tolist())
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data) // 8 * 8, 8)]
    lane_a = lane_b = 0
    for i, w in enumerate(words):
        k = (i * fp_mod._K_POS) & MASK64
        x = ((w ^ k) * fp_mod._C1) & MASK64
        x ^= x >> 32
        x = (x * fp_mod._C2) & MASK64
        x ^= x >> 29
        lane_a = (lane_a + x) & MASK64
        lane_b = (lane_b + x * k) & MASK64
    expected = struct.pack("<qqq", len(words), *(v - (1 << 64) if v >> 63 else v for v in (lane_a, lane_b)))
    assert fp_mod._word_digest(t) == expected + data[len(words) * 8 :]


def test_chunk_size_and_threads_do_not_change_the_digest() -> None:
    t = torch.randn(70_001, generator=torch.Generator().manual_seed(4))
    digest = fingerprint(t)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert fingerprint(t) == digest
    finally:
        torch.set_num_threads(threads)
    small = t[:3001]
    with mock.patch.object(fp_mod, "SMALL_TENSOR_BYTES", -1):
        digest = fingerprint(small)
        for chunk in (1, 7, 1000, 1 << 20):
            with mock.patch.object(fp_mod, "_CPU_CHUNK_WORDS", chunk):
                assert fingerprint(small) == digest, chunk


def test_intra_op_threads_chunks_and_kept_buffers_do_not_change_the_digest() -> None:
    """Large CPU chunks run on torch's intra-op threads; the scratch buffers are kept per thread."""
    t = random_tensor((300_000 * 8 + 5,), torch.uint8, seed=5)  # ops above the parallel grain
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        sequential = [fingerprint(v) for v in (t, t[3:], t[8:])]  # misaligned starts are copied
        for n in (2, 3):
            torch.set_num_threads(n)
            assert [fingerprint(v) for v in (t, t[3:], t[8:])] == sequential, n
    finally:
        torch.set_num_threads(threads)
    for chunk in (1000, 7, 1 << 20):  # buffers kept from a larger chunk are sliced, not rebuilt
        with mock.patch.object(fp_mod, "_CPU_CHUNK_WORDS", chunk):
            assert fingerprint(t) == sequential[0], chunk
    small = random_tensor((9000 * 8,), torch.uint8, seed=6)
    digest = fingerprint(small)  # a smaller tensor after a larger one, and on a fresh thread
    assert fingerprint(t) == sequential[0] and fingerprint(small) == digest
    found: list[str] = []
    worker = threading.Thread(target=lambda: found.extend([fingerprint(small), fingerprint(t)]))
    worker.start()
    worker.join()
    assert found == [digest, sequential[0]]
    assert fingerprint(flip_bit(t, 200_000 * 64 + 3)) != sequential[0]


def test_non_contiguous_views_hash_like_their_contiguous_copies(path: str) -> None:
    base = random_tensor((6, 10, 9), torch.float32, seed=5)
    views = [
        base[:, ::2],
        base[1:, :, 3:],
        base.permute(2, 0, 1),
        base.transpose(0, 2),
        base[..., 1],
        base.expand(2, 6, 10, 9),
        base.reshape(-1)[1::3],
        base.to(torch.uint8)[:, :, 1:],  # odd byte counts per row
    ]
    for v in views:
        assert fingerprint(v) == fingerprint(v.contiguous())
        assert fingerprint(v) == fingerprint(v.clone(memory_format=torch.contiguous_format))


def test_conjugate_and_negative_views_hash_as_their_values() -> None:
    z = torch.randn(4, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(6))
    assert z.conj().is_conj()
    assert fingerprint(z.conj()) == fingerprint(z.conj().resolve_conj())
    assert fingerprint(z.conj()) != fingerprint(z)
    assert fingerprint(z.conj().imag) == fingerprint(-z.imag)


def test_large_non_contiguous_tensor_word_path() -> None:
    t = torch.randn(300, 301, generator=torch.Generator().manual_seed(7))
    with mock.patch.object(fp_mod, "_CPU_CHUNK_WORDS", 64):
        assert fingerprint(t.t()) == fingerprint(t.t().contiguous())
        assert fingerprint(t.t()) != fingerprint(t)


def test_requires_grad_parameters_and_devices_of_equal_values() -> None:
    w = torch.randn(3, 4, generator=torch.Generator().manual_seed(8))
    p = torch.nn.Parameter(w.clone())
    assert fingerprint(p) == fingerprint(w)
    assert fingerprint(w.clone().requires_grad_()) == fingerprint(w)


# --- property tests ----------------------------------------------------------------------------

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)
dtypes = st.sampled_from([torch.float32, torch.float64, torch.int16, torch.uint8, torch.bfloat16, torch.bool])


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes, dtype=dtypes, seed=st.integers(0, 2**32 - 1), bit=st.integers(0, 10**6), words=st.booleans()
)
def test_property_single_bit_flip_always_changes_the_digest(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, bit: int, words: bool
) -> None:
    t = random_tensor(shape, dtype, seed)
    bit %= t.numel() * t.element_size() * 8
    with mock.patch.object(fp_mod, "SMALL_TENSOR_BYTES", -1 if words else fp_mod.SMALL_TENSOR_BYTES):
        assert fingerprint(flip_bit(t, bit)) != fingerprint(t)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**32 - 1), data=st.data(), words=st.booleans())
def test_property_permuting_elements_changes_the_digest(
    shape: tuple[int, ...], seed: int, data: st.DataObject, words: bool
) -> None:
    t = random_tensor(shape, torch.float32, seed)
    flat = t.reshape(-1)
    perm = torch.tensor(data.draw(st.permutations(range(flat.numel()))))
    permuted = flat[perm].reshape(shape)
    with mock.patch.object(fp_mod, "SMALL_TENSOR_BYTES", -1 if words else fp_mod.SMALL_TENSOR_BYTES):
        if torch.equal(permuted.view(torch.int32), t.view(torch.int32)):
            assert fingerprint(permuted) == fingerprint(t)
        else:
            assert fingerprint(permuted) != fingerprint(t)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_property_layout_never_matters(shape: tuple[int, ...], seed: int, data: st.DataObject) -> None:
    t = random_tensor(shape, torch.float64, seed)
    order = data.draw(st.permutations(range(len(shape))))
    inverse = [order.index(i) for i in range(len(shape))]
    strided = t.permute(*order).contiguous().permute(*inverse)  # same values, other strides
    step = data.draw(st.integers(1, 3))
    for words in (False, True):
        with mock.patch.object(fp_mod, "SMALL_TENSOR_BYTES", -1 if words else fp_mod.SMALL_TENSOR_BYTES):
            assert fingerprint(strided) == fingerprint(t)
            assert fingerprint(strided[..., ::step]) == fingerprint(t[..., ::step].clone())


# --- other tensor kinds ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
def test_sparse_tensors_hash_their_canonical_representation() -> None:
    i = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])
    v = torch.tensor([3.0, 4.0, 5.0, 1.0])
    coo = torch.sparse_coo_tensor(
        i, v, (2, 3), check_invariants=True
    )  # duplicate (0, 2) is summed by coalesce
    assert fingerprint(coo) == fingerprint(coo.coalesce())
    assert fingerprint(coo) != fingerprint(torch.sparse_coo_tensor(i, v + 1, (2, 3), check_invariants=True))
    assert fingerprint(coo) != fingerprint(coo.to_dense())
    dense = coo.to_dense()
    csr = dense.to_sparse_csr()
    assert fingerprint(csr) == fingerprint(dense.clone().to_sparse_csr())
    assert fingerprint(csr) != fingerprint(dense.to_sparse_csc())
    assert fingerprint(csr) != fingerprint((dense * 2).to_sparse_csr())


@pytest.mark.filterwarnings("ignore:.*quantize.*deprecated:UserWarning")
def test_quantized_tensors_include_scale_and_zero_point() -> None:
    x = torch.linspace(-1, 1, 10)
    q = torch.quantize_per_tensor(x, 0.1, 2, torch.qint8)
    assert fingerprint(q) == fingerprint(torch.quantize_per_tensor(x.clone(), 0.1, 2, torch.qint8))
    assert fingerprint(q) != fingerprint(torch.quantize_per_tensor(x, 0.1, 3, torch.qint8))
    assert fingerprint(q) != fingerprint(torch.quantize_per_tensor(x, 0.2, 2, torch.qint8))
    qc = torch.quantize_per_channel(
        x.reshape(2, 5), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8
    )
    assert fingerprint(qc) != fingerprint(
        torch.quantize_per_channel(
            x.reshape(2, 5), torch.tensor([0.1, 0.3]), torch.tensor([0, 1]), 0, torch.quint8
        )
    )


def test_meta_tensors_are_refused_with_their_path() -> None:
    with pytest.raises(TypeError, match=r"meta tensor at obj\['w'\]"):
        fingerprint({"w": torch.empty(3, device="meta")})


# --- modules, optimizers, containers -----------------------------------------------------------


def make_model(seed: int) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def test_module_hashes_as_its_state_dict_buffers_included() -> None:
    m = make_model(0)
    assert fingerprint(m) == fingerprint(m.state_dict()) == fingerprint(make_model(0))
    assert fingerprint(m) != fingerprint(make_model(1))
    m2 = make_model(0)
    m2[1].running_mean += 1  # a buffer only
    assert fingerprint(m2) != fingerprint(m)


def test_optimizer_state_is_hashed_and_changes_with_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # the first optimizer step imports torch's compiler stack, which sets this variable
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    m = make_model(0)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, foreach=False)
    before = fingerprint(opt)
    assert before == fingerprint(opt.state_dict())
    m(torch.ones(3, 4)).sum().backward()
    opt.step()
    assert fingerprint(opt) != before
    other = torch.optim.SGD(make_model(0).parameters(), lr=2e-3, momentum=0.9, foreach=False)
    assert fingerprint(other) != before
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    assert fingerprint(sched) == fingerprint(sched.state_dict())


def test_containers_and_plain_values() -> None:
    a = {"x": 1, "y": [1.5, "s", None, b"b"], "z": (True, 2 + 1j)}
    b = {"z": (True, 2 + 1j), "y": [1.5, "s", None, b"b"], "x": 1}  # other insertion order
    assert fingerprint(a) == fingerprint(b) == fingerprint(OrderedDict(b))
    assert fingerprint([1, 2]) != fingerprint([2, 1])
    assert fingerprint([1, 2]) == fingerprint((1, 2))
    distinct = [
        1,
        True,
        1.0,
        "1",
        b"1",
        [1],
        {1},
        {1: None},
        None,
        0.0,
        -0.0,
        float("nan"),
        2**80,
        torch.tensor(1),
    ]
    assert len({fingerprint(v) for v in distinct}) == len(distinct)
    assert fingerprint({"a": [1]}) != fingerprint({"a": [[1]]})
    assert fingerprint(torch.float32) != fingerprint(torch.float64)
    point = namedtuple("point", "x y")
    assert fingerprint(point(1, 2)) == fingerprint((1, 2))


@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    label: int


def test_dataclasses_and_numpy() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert fingerprint(Batch(t, 1)) == fingerprint(Batch(t.clone(), 1))
    assert fingerprint(Batch(t, 1)) != fingerprint(Batch(t, 2))
    arr = t.numpy()
    assert fingerprint(arr) == fingerprint(t)
    assert fingerprint(arr.T) == fingerprint(t.T)
    assert fingerprint(arr[::-1]) == fingerprint(t.flip(0))
    ro = arr.copy()
    ro.flags.writeable = False
    assert fingerprint(ro) == fingerprint(t)
    assert fingerprint(arr.astype(">f4")) == fingerprint(t)  # byte order is not part of the value
    assert fingerprint(np.float32(2.5)) == fingerprint(torch.tensor(2.5))
    assert fingerprint(np.array(["ab", "c"])) != fingerprint(np.array(["ab", "d"]))
    with pytest.raises(TypeError, match=r"object array at obj\[0\]"):
        fingerprint([np.array([object()])])


def test_unsupported_objects_name_type_and_path() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"Opaque at obj\['model'\]\[2\]\.payload"):
        fingerprint({"model": [1, 2, Holder(Opaque())]})
    with pytest.raises(TypeError, match="type function at obj"):
        fingerprint(lambda: 0)
    cycle: list[Any] = [1]
    cycle.append(cycle)
    with pytest.raises(ValueError, match=r"obj\[1\] contains itself"):
        fingerprint(cycle)
    shared = [1]
    assert fingerprint([shared, shared]) == fingerprint([[1], [1]])  # sharing is not a cycle


@dataclasses.dataclass
class Holder:
    payload: Any


def test_fingerprinting_flag_is_set_only_inside() -> None:
    seen = []

    class Probe:
        def state_dict(self) -> dict[str, bool]:
            seen.append(fp_mod.fingerprinting())
            return {}

    assert not fp_mod.fingerprinting()
    fingerprint(Probe())
    assert seen == [True] and not fp_mod.fingerprinting()


# --- across processes --------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, torch
    from torchrepro import fingerprint
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(11)
    big = torch.randn(3000, 401, generator=g)
    torch.manual_seed(0)
    objs = {
        "big_t": big.t(),
        "small": torch.arange(10, dtype=torch.float16),
        "nested": {str(i): [i, float(i), {"k": i}] for i in range(20)},
        "set": {"apple", "pear", "plum"},
        "model": torch.nn.Linear(5, 3),
    }
    out = {k: fingerprint(v) for k, v in objs.items()}
    big[5, 7] = -big[5, 7]
    out["big_t flipped"] = fingerprint(big.t())
    print(json.dumps(out))
    """
)


def test_same_digests_in_a_fresh_process_with_other_hash_seed_and_threads(rng_changes_ok: None) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout)
    g = torch.Generator().manual_seed(11)
    big = torch.randn(3000, 401, generator=g)
    torch.manual_seed(0)
    here = {
        "big_t": fingerprint(big.t().contiguous()),
        "small": fingerprint(torch.arange(10, dtype=torch.float16)),
        "nested": fingerprint({str(i): [i, float(i), {"k": i}] for i in range(20)}),
        "set": fingerprint({"plum", "apple", "pear"}),
        "model": fingerprint(torch.nn.Linear(5, 3)),
    }
    assert {k: child[k] for k in here} == here
    assert child["big_t flipped"] != here["big_t"]  # negative control: one flipped sign bit


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (5,), (3, 4), (2, 1, 3)])
def test_small_tensor_fast_path_equals_the_digest_format(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The cached-header fast path gives the format's value, every time (the header's hash state
    is cached per dtype and shape), also after the cache was emptied."""
    import hashlib

    t = random_tensor(shape, dtype, seed=len(shape) + 3)
    body = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    header = fp_mod._header(b"tensor", str(t.dtype), tuple(t.shape))
    expected = fp_mod._blake(header, b"small", hashlib.sha256(body).digest()).hex()
    assert fingerprint(t) == expected
    assert fingerprint(t) == expected  # from the cached header
    fp_mod._SMALL_HEADS.clear()
    assert fingerprint(t.detach()) == expected
    if t.dim() == 2:  # another layout of the same values takes the general path: same digest
        assert fingerprint(t.t().contiguous().t()) == expected


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.lists(st.text(max_size=40), max_size=8))
def test_fingerprint_texts_equals_fingerprint_of_the_list(head: str, texts: list[str]) -> None:
    assert fp_mod.fingerprint_texts(head, texts) == fingerprint([head, texts])
