"""InvariantDataParallel over FSDP2: the unsharded run's bits on every world size, in real processes.

An MLP of blocks with LayerNorm and dropout, AdamW, clipping, global batches of V = 8 micro-batches
(tests/invariant/scripts/fsdp_train.py), ``fully_shard`` per block and at the root. One plain
process (a process group of one) and torchrun with 2 and 4 ranks (gloo, 1 thread per rank; the last
Linear's 3 rows leave rank 3 of 4 an empty shard); each launch runs every mode from the RNG state
a fresh process has. The final parameters and AdamW state, gathered whole, and every step's
clipping norm: FSDP2 on W in {1, 2, 4} equals unsharded InvariantDataParallel on W in {1, 2, 4};
with MixedPrecisionPolicy(bfloat16 parameters, float32 reduction) too. The 2-rank run saves a
sharded checkpoint (DCP) after every step; the 1- and 4-rank launches resume from each of them.
Negative controls: stock FSDP2 with gradient accumulation differs between 1, 2 and 4 processes,
and torch's clip_grad_norm_ over the same (invariant) sharded gradients gives other norms.

The same launches run ``clip_fsdp.py``'s comparison of the clipping alone: one small MLP's
gradients, whole on one process (DDP's view) and FSDP2-sharded unevenly on 2 and 4 ranks (an empty
shard on 4), in float32 and float64: ``clip_grad_norm_``'s total and clipped gradients are the same
bits on all three. Negative control: torch's own total of the same float64 gradients differs under
FSDP2 (it sums each rank's shard, then the ranks); its float32 total happened to agree here (on the
CPU torch accumulates a float32 norm in float64 and rounds once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchrepro
from helpers import gloo_group_of_one
from torchrepro.errors import InvariantTrainingError

SCRIPT = Path(__file__).parent / "scripts" / "fsdp_train.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")
WORLDS = (1, 2, 4)
MODES = "fsdp,unsharded,stock,torchclip,mixed,clip"
DTYPES = ("torch.float32", "torch.float64")


def launch(out: Path, world: int, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT)]
    if world > 1:  # torchrepro run ends the ranks once gloo is idle (plain torchrun may abort one)
        record = out.with_name(out.stem + "-record")
        cmd = [sys.executable, "-m", "torchrepro", "run", "--mode", "off", "--record", str(record)]
        cmd += ["--nproc", str(world), str(SCRIPT)]
    proc = subprocess.run(
        [*cmd, str(out), "--modes", MODES, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=out.parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fsdp")
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    out = {2: launch(tmp / "w2.json", 2, "--save", str(ckpt))}
    for world in (1, 4):
        out[world] = launch(tmp / f"w{world}.json", world, "--resume", str(ckpt))
    out[0] = {"checkpoints": sorted(p.name for p in ckpt.iterdir())}  # type: ignore[dict-item]
    return out


def finals(runs: dict[int, dict[str, Any]], mode: str) -> dict[int, list[str]]:
    out = {world: runs[world][mode]["final"] for world in WORLDS}
    for world, ranks in out.items():
        assert len(ranks) == world
    return out


@pytest.mark.slow
def test_fsdp2_on_every_world_size_ends_with_the_unsharded_bits(runs: dict) -> None:
    values = {fp for mode in ("fsdp", "unsharded") for ranks in finals(runs, mode).values() for fp in ranks}
    assert len(values) == 1, {mode: finals(runs, mode) for mode in ("fsdp", "unsharded")}
    norms = {json.dumps(runs[w][mode]["norms"]) for w in WORLDS for mode in ("fsdp", "unsharded")}
    assert len(norms) == 1 and len(runs[1]["fsdp"]["norms"]) == 3, norms  # 3 steps, clipping active
    assert all(float.fromhex(n) > 0.05 for n in runs[1]["fsdp"]["norms"])


@pytest.mark.slow
def test_a_sharded_checkpoint_of_2_ranks_resumes_exactly_on_1_and_4(runs: dict) -> None:
    """Saved through DCP after every step of the 2-rank run, resharded onto 1 and 4 ranks."""
    steps = [f"step-{k}.pt" for k in (1, 2, 3)]
    assert runs[0]["checkpoints"] == sorted(
        [*steps, *(f"{s}.dcp" for s in steps), *(f"{s}.rank1" for s in steps)]
    )
    expected = runs[2]["fsdp"]["final"][0]
    for world in (1, 4):
        for step in steps:
            assert runs[world][f"resumed:{step}"]["final"] == [expected] * world, (world, step)


@pytest.mark.slow
def test_mixed_precision_keeps_the_bits_on_every_world_size(runs: dict) -> None:
    mixed = finals(runs, "mixed")
    assert len({fp for ranks in mixed.values() for fp in ranks}) == 1, mixed
    assert mixed[1] != finals(runs, "fsdp")[1]  # bfloat16 parameters: another run, not a no-op


@pytest.mark.slow
def test_stock_fsdp2_differs_across_world_sizes(runs: dict) -> None:
    stock = {world: ranks[0] for world, ranks in finals(runs, "stock").items()}
    assert len(set(stock.values())) == len(WORLDS), stock


@pytest.mark.slow
def test_torch_clipping_over_sharded_gradients_differs_across_world_sizes(runs: dict) -> None:
    norms = {world: json.dumps(runs[world]["torchclip"]["norms"]) for world in WORLDS}
    assert len(set(norms.values())) > 1, norms
    torchclip = {world: ranks[0] for world, ranks in finals(runs, "torchclip").items()}
    assert len(set(torchclip.values())) > 1, torchclip


# -- clip_grad_norm_ alone (tests/invariant/scripts/clip_fsdp.py, in the same launches) ---------


@pytest.mark.slow
def test_clip_the_shards_are_uneven_and_one_is_empty(runs: dict) -> None:
    four = runs[4]["clip"]["torch.float32"]["shards"]
    assert [rank[4][0] for rank in four] == [2, 2, 1, 0]  # the last Linear's 5 rows on 4 ranks
    assert [rank[0][0] for rank in runs[2]["clip"]["torch.float32"]["shards"]] == [12, 12]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_the_gradients_before_clipping_are_the_same_bits_on_every_world_size(
    runs: dict, dtype: str
) -> None:
    """FSDP2 averages W identical gradients: the plain ones, so what follows tests the clipping."""
    assert len({runs[w]["clip"][dtype]["before"] for w in WORLDS}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_our_total_and_clipped_gradients_are_the_same_bits_for_1_2_and_4_ranks(
    runs: dict, dtype: str
) -> None:
    totals = {w: runs[w]["clip"][dtype]["ours"] for w in WORLDS}
    for world, ranks in totals.items():
        assert len(ranks) == world
    assert len({t for ranks in totals.values() for t in ranks}) == 1, totals
    assert len({runs[w]["clip"][dtype]["after"] for w in WORLDS}) == 1
    assert runs[1]["clip"][dtype]["after"] != runs[1]["clip"][dtype]["before"]  # clipping scaled them


@pytest.mark.slow
def test_clip_negative_control_torchs_total_differs_between_world_sizes(runs: dict) -> None:
    theirs = {w: runs[w]["clip"]["torch.float64"]["torch"] for w in WORLDS}
    for ranks in theirs.values():
        assert len(set(ranks)) == 1  # the same on every rank of one run, but not across runs:
    assert len({ranks[0] for ranks in theirs.values()}) > 1, theirs
    ours = {runs[w]["clip"]["torch.float64"]["ours"][0] for w in WORLDS}
    assert len(ours) == 1


# -- refusals, in this process on a process group of one --------------------------------------


@pytest.fixture
def group_of_one(tmp_path: Path, rng_changes_ok: None) -> Iterator[None]:
    with gloo_group_of_one(tmp_path / "store"):
        yield


def _loader() -> torchrepro.SeededLoader:
    data = [(torch.randn(4), 0) for _ in range(8)]
    return torchrepro.SeededLoader(data, batch_size=2, global_batch_size=8, seed=0)


def test_fsdp2_without_the_root_sharded_is_refused(group_of_one: None) -> None:
    from torch.distributed.fsdp import fully_shard

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(net[0])
    with pytest.raises(InvariantTrainingError, match=r"fully_shard applied at the root too"):
        torchrepro.InvariantDataParallel(net, _loader())


def test_hsdp_is_refused_naming_the_mesh(group_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(net, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
    with pytest.raises(InvariantTrainingError, match=r"2-D mesh .* HSDP"):
        torchrepro.InvariantDataParallel(net, _loader())


def test_a_micro_batch_of_fsdp2_on_one_rank_keeps_the_unsharded_gradient(group_of_one: None) -> None:
    """In process, one global batch of 4 micro-batches: the sharded wrapper's .grad, gathered,
    equals the plain wrapper's bit for bit."""
    from torch.distributed.fsdp import fully_shard

    def grads(sharded: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 3))
        if sharded:
            fully_shard(net[0])
            fully_shard(net)
        loader = _loader()
        model = torchrepro.InvariantDataParallel(net, loader)
        for x, _ in loader:
            (model(x * 1e3).square().sum() * 1e-3).backward()
        return [(p.grad.full_tensor() if sharded else p.grad).clone() for p in net.parameters()]

    plain, sharded = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, sharded, strict=True))
