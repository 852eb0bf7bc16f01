"""pipeline/eager.py: an eager process trains and counts FLOPs without importing torch._dynamo, and
its optimizer steps give the bits of torch's own ``opt.step()``.

Each case runs in a fresh interpreter: the test process has imported ``torch._dynamo`` long ago
(other tests step optimizers through torch's wrappers), and :func:`skip_dynamo` then leaves
everything as torch made it."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.cli_driver import child_env

ROOT = Path(__file__).resolve().parents[1]

# Steps SGD (momentum, Nesterov), torch's fused AdamW and PortableAdamW through OptimGroup, then
# the same from the same start through torch's opt.step(); counts a subnet's FLOPs in between.
_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    from pipeline import eager
    from pipeline.memory.optim import OptimConfig, OptimGroup
    eager.skip_dynamo()  # (what search.app.prepare does first)
    out = {}
    configs = {"sgd": OptimConfig("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
               "adamw": OptimConfig("adamw", lr=3e-3, weight_decay=0.01),
               "portable": OptimConfig("adamw", lr=3e-3, weight_decay=0.01, portable=True)}
    def run(config, plain):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        opt = config.build(list(net.parameters()))
        group = OptimGroup(config, torch.device("cpu"))
        for _ in range(3):
            net(torch.randn(5, 8)).square().mean().backward()
            if plain:
                opt.param_groups[0]["lr"] = config.lr
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                group.step([("op", opt)], config.lr)
        return [p.detach().clone() for p in net.parameters()]
    mine = {name: run(c, plain=False) for name, c in configs.items()}
    from torch.utils.flop_counter import FlopCounterMode
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        nn.Conv2d(3, 4, 3, device="meta")(torch.zeros(1, 3, 8, 8, device="meta"))
    out["flops"] = counter.get_total_flops()
    out["dynamo_before"] = "torch._dynamo" in sys.modules
    out["same"] = {name: all(torch.equal(a, b) for a, b in zip(mine[name], run(c, plain=True)))
                   for name, c in configs.items()}
    print(json.dumps(out))
""")


def _run(script: str, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=child_env(**env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_training_and_flops_without_dynamo_same_bits_as_torch_step() -> None:
    got = _run(_SCRIPT, PIPENAS_KEEP_DYNAMO="0")
    assert got["dynamo_before"] is False  # optimizers built, stepped, FLOPs counted: no import
    assert got["flops"] > 0
    assert got["same"] == {"sgd": True, "adamw": True, "portable": True}


def test_keep_dynamo_leaves_torch_as_it_is() -> None:
    got = _run(_SCRIPT, PIPENAS_KEEP_DYNAMO="1")
    assert got["dynamo_before"] is True
    assert got["same"] == {"sgd": True, "adamw": True, "portable": True}


def test_a_step_hook_still_runs() -> None:
    """With a step hook registered, the step goes through torch's wrapper, which runs it."""
    got = _run(textwrap.dedent("""
        import json, torch
        from torch import nn
        from pipeline import eager
        assert eager.skip_dynamo() > 0
        net = nn.Linear(2, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        seen = []
        opt.register_step_post_hook(lambda *a: seen.append(1))
        net(torch.ones(1, 2)).sum().backward()
        eager.step(opt)
        print(json.dumps({"hook": len(seen)}))
    """), PIPENAS_KEEP_DYNAMO="0")
    assert got == {"hook": 1}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("space", ["default", "transformer"])
def test_a_run_imports_no_dynamo(space: str, device: str, tmp_path: Path) -> None:
    """The app in one process, training and searching: torch._dynamo never imported. (On CUDA,
    torch's own ``use_deterministic_algorithms`` imported it, through ``torch._inductor.config``:
    seen with torch 2.11 on an H100, bench/RESULTS.md's fifth GPU session; pipeline/determinism.py
    now sets the kernels' switch alone, the test below.)"""
    overrides = ["train.steps=12", "train.warmup_steps=2", "search.population=4", "search.generations=1",
                 "threads=1", f"device={device}", f"hydra.run.dir={tmp_path}"]
    if space == "transformer":
        overrides += ["space=transformer", "space.width=32", "space.layers=2"]
    got = _run(textwrap.dedent(f"""
        import json, sys
        from search.__main__ import status
        code = status(["search", *{overrides!r}])
        print(json.dumps({{"code": code, "dynamo": "torch._dynamo" in sys.modules}}))
    """), PIPENAS_KEEP_DYNAMO="0")
    assert got == {"code": 0, "dynamo": False}


@pytest.mark.parametrize("keep", ["0", "1"])
def test_deterministic_kernels_without_the_compiler_unless_the_process_compiles(keep: str) -> None:
    """pipeline/determinism.py for a CUDA device (its flags are set on any build): the kernels'
    switch on, warn only; torch's compiler (and torch._dynamo) imported only under
    ``PIPENAS_KEEP_DYNAMO=1``, whose public call also sets the compiler's flag."""
    got = _run(textwrap.dedent("""
        import json, sys, torch
        from pipeline.determinism import use_deterministic_kernels
        use_deterministic_kernels("cuda:0")
        on = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        inductor = "torch._inductor.config" in sys.modules
        flag = sys.modules["torch._inductor.config"].deterministic if inductor else None
        use_deterministic_kernels("cuda:0", on=False)
        print(json.dumps({"on": on, "off": torch.are_deterministic_algorithms_enabled(), "inductor": inductor,
                          "flag": flag, "dynamo": "torch._dynamo" in sys.modules}))
    """), PIPENAS_KEEP_DYNAMO=keep)
    assert got["on"] == [True, True] and got["off"] is False
    if keep == "1":
        assert got["inductor"] and got["flag"] is True
    else:
        assert got == {**got, "inductor": False, "dynamo": False}
