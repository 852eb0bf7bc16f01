"""search.export end to end: a tiny run's subnet exported through the command line scores what the
search scored (module + model.pt and the model.pt2 program), the program loads in a process that
imports nothing of this project, a DAG space, and bad input (exit 2, one line, nothing written)."""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from search.app import run
from search.checkpoint import load_checkpoint
from search.config import build_data, load_config
from search.export import ARCH_NAME, CONFIG_PATH, MODEL_NAME, PROGRAM_NAME, load_module, main
from tests.test_app import make_cfg

SHORT = ["train.steps=6"]  # TINY with fewer steps: training is not what is tested here
CELL = ["~space", "+space._target_=supernet.spaces.cell.build", "+space.channels=4", "+space.cells=1"]


@dataclass(frozen=True)
class Cli:
    status: int
    stdout: str
    stderr: str


def export_cli(*argv: str) -> Cli:
    """``python -m search.export *argv``, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return Cli(status, out.getvalue(), err.getvalue())


def tiny_run(out: Path, *overrides: str) -> tuple[dict, object]:
    """A tiny run in ``out`` with its config where Hydra keeps it; (summary, config)."""
    cfg = make_cfg(*overrides, *SHORT)
    summary = run(cfg, output_dir=out)
    (out / CONFIG_PATH).parent.mkdir()
    OmegaConf.save(cfg, out / CONFIG_PATH)  # what a `python -m search` run has beside its outputs
    return summary, cfg


@pytest.fixture(scope="module")
def conv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, object, Cli]:
    out = tmp_path_factory.mktemp("conv")
    summary, cfg = tiny_run(out)
    return out, summary, cfg, export_cli(str(out))


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, object, Cli]:
    out = tmp_path_factory.mktemp("cell")
    summary, cfg = tiny_run(out, *CELL)
    return out, summary, cfg, export_cli(str(out))


@torch.no_grad()
def score(forward, batches) -> tuple[float, float]:
    """(accuracy, mean loss) as the engines score a subnet."""
    loss, correct, total = 0.0, 0, 0
    for x, y in batches:
        logits = forward(x)
        loss += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(-1) == y).sum())
        total += int(y.shape[0])
    return correct / total, loss / total


def check_export(run_dir: Path, cfg, entry: dict, export_dir: Path) -> None:
    """The exported module (model.pt) and program (model.pt2) score ``entry`` (a summary's
    best or top-k entry) exactly: the same accuracy and the same loss, to the bit."""
    rc = load_config(cfg)
    batches = build_data(rc.data).val_batches(rc.search.val_batch_size)
    info = json.loads((export_dir / ARCH_NAME).read_text())
    assert info["arch"] == entry["arch"] and info["val_accuracy"] == entry["val_accuracy"]
    assert info["program_val_accuracy"] == entry["val_accuracy"] and info["program_note"] is None

    module = load_module(export_dir)  # model.pt loads strictly into it
    assert not module.training
    assert score(module, batches) == (entry["val_accuracy"], entry["val_loss"])
    program = torch.export.load(export_dir / PROGRAM_NAME).module()
    assert score(program, batches) == (entry["val_accuracy"], entry["val_loss"])
    x = batches[0][0]
    assert torch.equal(program(x), module(x)) and torch.equal(program(x[:3]), module(x[:3]))  # any batch size

    # batch norm was recalibrated for the subnet: its statistics are not the supernet's
    states = load_checkpoint(run_dir / "checkpoint.pt").op_states
    saved = torch.load(export_dir / MODEL_NAME, weights_only=True)
    changed = [key for op_id in info_op_ids(info) for key, t in saved.items()
               if key.startswith(f"ops.{op_id}.") and key.endswith("running_mean")
               and not torch.equal(t, states[op_id]["buffer/" + key.removeprefix(f"ops.{op_id}.")])]
    assert changed


def info_op_ids(info: dict) -> list[str]:
    return [op["op_id"] for op in info["ops"]]


def test_export_of_the_best_arch_scores_what_the_search_scored(conv) -> None:
    run_dir, summary, cfg, cli = conv
    out = run_dir / "export" / "best"
    assert cli.status == 0, cli.stderr
    lines = cli.stdout.splitlines()
    assert lines[:3] == [f"wrote {out / name}" for name in (MODEL_NAME, PROGRAM_NAME, ARCH_NAME)]
    acc = summary["best"]["val_accuracy"]
    assert lines[3].startswith(f"val accuracy: {acc:.4f} (") and "model.pt2 alike" in lines[3] and len(lines) == 4
    check_export(run_dir, cfg, summary["best"], out)
    info = json.loads((out / ARCH_NAME).read_text())
    assert info["input_shape"] == [1, 8, 8] and info["num_classes"] == 10 and info["search_val_accuracy"] == acc
    assert sorted(p.name for p in out.iterdir()) == sorted([MODEL_NAME, PROGRAM_NAME, ARCH_NAME])


def test_program_loads_in_a_process_without_this_project(conv, tmp_path: Path) -> None:
    run_dir, _, cfg, cli = conv
    assert cli.status == 0, cli.stderr
    out = run_dir / "export" / "best"
    x = build_data(load_config(cfg).data).val_batches(64)[0][0]
    torch.save(x, tmp_path / "x.pt")
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        PROJECT = ("supernet", "pipeline", "search", "tests")

        class Refuse(importlib.abc.MetaPathFinder):  # the project cannot even be imported here
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in PROJECT:
                    raise ImportError(f"{{name}}: this process must not need it")

        sys.meta_path.insert(0, Refuse())
        import torch
        program = torch.export.load({str(out / PROGRAM_NAME)!r}).module()
        with torch.no_grad():
            torch.save(program(torch.load({str(tmp_path / "x.pt")!r})), {str(tmp_path / "logits.pt")!r})
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT)
        assert not loaded, loaded
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), load_module(out)(x))


def test_dag_space_and_an_arch_of_ones_choice(cell) -> None:
    run_dir, summary, cfg, cli = cell
    assert cli.status == 0, cli.stderr
    check_export(run_dir, cfg, summary["best"], run_dir / "export" / "best")
    info = json.loads((run_dir / "export" / "best" / ARCH_NAME).read_text())
    assert any(len(op["inputs"]) == 3 for op in info["ops"])  # node 3 sums three edges: a DAG

    other = summary["top_k"][-1]  # --arch: another scored arch, into export/<its slug>
    again = export_cli(str(run_dir), "--arch", json.dumps(other["arch"]))
    slug = "-".join(v for _, v in sorted(other["arch"].items()))
    assert again.status == 0, again.stderr
    assert again.stdout.splitlines()[0] == f"wrote {run_dir / 'export' / slug / MODEL_NAME}"
    check_export(run_dir, cfg, other, run_dir / "export" / slug)


def tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", ["no summary", "no checkpoint", "no config", "arch value", "arch label",
                                  "arch json", "out blocked"])
def test_bad_input_fails_in_one_line_and_writes_nothing(conv, tmp_path: Path, case: str) -> None:
    run_dir, summary, _, _ = conv
    arch = dict(summary["best"]["arch"])
    args, expect = [str(run_dir)], ""
    if case.startswith("no "):  # a copy of the run directory without one of its files
        files = {"summary": "summary.json", "checkpoint": "checkpoint.pt", "config": str(CONFIG_PATH)}
        copy = tmp_path / "run"
        for what, name in files.items():
            if what != case.removeprefix("no "):
                (copy / name).parent.mkdir(parents=True, exist_ok=True)
                (copy / name).write_bytes((run_dir / name).read_bytes())
        args, expect = [str(copy)], f"error: {copy / files[case.removeprefix('no ')]}: expected "
    elif case == "arch value":
        args += ["--arch", json.dumps({**arch, "layer00": "k9e9"})]
        expect = "error: --arch.layer00: expected one of ['k3e3', 'k3e6', 'k5e3', 'k5e6', 'skip'], found 'k9e9'"
    elif case == "arch label":
        args += ["--arch", json.dumps({**arch, "layer99": "skip"})]
        expect = "error: --arch.layer99: unknown label; expected labels are"
    elif case == "arch json":
        args += ["--arch", "{layer00: skip"]
        expect = "error: --arch: expected a JSON object label -> value, found '{layer00: skip'"
    else:
        (tmp_path / "a_file").write_text("")
        args += ["--out", str(tmp_path / "a_file" / "export")]
        expect = f"error: --out: expected a directory you can create, found a file in its way: {tmp_path / 'a_file'}"
    before = {"run": tree(run_dir), "tmp": tree(tmp_path)}
    cli = export_cli(*args)
    assert cli.status == 2 and cli.stdout == ""
    assert len(cli.stderr.splitlines()) == 1 and cli.stderr.startswith(expect), cli.stderr
    assert {"run": tree(run_dir), "tmp": tree(tmp_path)} == before
