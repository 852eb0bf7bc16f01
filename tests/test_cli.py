"""The command line end to end: exit statuses, one-line errors, interrupts, restarts, the README.

Every ``python -m search`` case runs in one interpreter (:mod:`tests.cli_driver`: start-up
dominates); the torchrun test runs one job that loses a rank three times (killed during compute,
during a checkpoint write, during a migration), restarts each time, is interrupted, and is resumed
by the same command: it ends with the one-process run's weights, and both runs print what the
README's example shows.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.trace import check_trace, spans_from_chrome
from search.__main__ import torchrun_argv
from search.app import run
from search.checkpoint import load_checkpoint
from search.evolution import SubnetCost
from supernet.spaces import conv
from tests.cli_driver import Case, Result, child_env, run_cases
from tests.test_app import TINY, TINY_CONV, make_cfg

ROOT = Path(__file__).resolve().parent.parent
DIVERGING = ["~space", "+space._target_=tests.diverging_space.build", "+space.at_step=7", "+space.at_microbatch=1"]


def readme_example() -> tuple[list[list[str]], list[list[str]]]:
    """The README's example block: its commands (split) and, per command, the lines it shows
    (without the elided log lines, ``[...]``)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- example: generated.*?-->\n```\n(.*?)```", text, re.S)
    assert block, "README.md lost its example block"
    commands: list[list[str]] = []
    outputs: list[list[str]] = []
    for line in block.group(1).splitlines():
        if line.startswith("$ "):
            commands.append(shlex.split(line[2:]))
            outputs.append([])
        elif not line.startswith("[...]"):
            outputs[-1].append(line)
    return commands, outputs


# the lines a run ends with, as patterns: the README's example and a run here differ only in the numbers
FORMS = (r"best arch: \{.*\}", r"val accuracy: \d\.\d{4} \(params \d+, flops \d+\)", r"output dir: \S+",
         r'  "params_digest": "[0-9a-f]{64}",')


def same_form(lines: list[str], readme: list[str]) -> bool:
    """Whether ``lines`` and the README's ``readme`` match the same :data:`FORMS`, line by line."""
    def form(line: str) -> str | None:
        return next((f for f in FORMS if re.fullmatch(f, line)), None)
    return len(lines) == len(readme) and all(form(a) is not None and form(a) == form(b) for a, b in zip(lines, readme))


def shown(stdout: str) -> list[str]:
    """What a run prints, without Hydra's log lines (``[2026-...][search.app][INFO] - ...``)."""
    return [line for line in stdout.splitlines() if not re.match(r"\[\d{4}-\d\d-\d\d ", line)]


UPDATE = os.environ.get("PIPENAS_UPDATE_README") == "1"


def update_readme(runs: list[tuple[list[str], list[str]]]) -> None:
    """Rewrite the README's example block from real runs: (command, shown output) each."""
    lines = []
    for cmd, out in runs:
        lines += ["$ " + shlex.join(cmd), *(["[...]"] if cmd[0] != "grep" else []), *out]
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"(<!-- example: generated.*?-->\n```\n).*?(```)", lambda m: m.group(1) + "\n".join(lines) + "\n"
                  + m.group(2), text, count=1, flags=re.S)
    (ROOT / "README.md").write_text(text)


def readme_errors() -> list[tuple[list[str], str]]:
    """The README's bad-input block: (arguments after ``python -m search``, the line it prints)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- errors: checked by tests/test_cli.py.*?-->\n```\n(.*?)```", text, re.S)
    assert block, "README.md lost its bad-input block"
    lines = block.group(1).splitlines()
    return [(shlex.split(cmd.removeprefix("$ "))[3:], err) for cmd, err in zip(lines[::2], lines[1::2])]


(TORCHRUN_CMD, ONE_CMD, _), (_, ONE_OUT, GREP_OUT) = readme_example()
EXAMPLE = ONE_CMD[ONE_CMD.index("search") + 1:]
README_ERRORS = readme_errors()


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # so that `tests.*` spaces import


def least_params() -> int:
    graph = conv.build(input_shape=(1, 8, 8), num_classes=10, layers=2, channels=[4, 8], downsample_at=[1])
    return SubnetCost(graph, (1, 8, 8)).cheapest(graph.space(), "params")[1]


CASES: dict[str, tuple[list[str], dict[str, str | None]]] = {
    # name: (arguments, environment); paths are relative to the test's directory, "{tmp}" is it
    "readme": (EXAMPLE, {}),
    **{f"readme-error-{i}": (args, {}) for i, (args, _) in enumerate(README_ERRORS)},  # run in {tmp}/errors
    "steps-abc-full-error": (["train.steps=abc", "hydra.run.dir={tmp}/rejected"], {"HYDRA_FULL_ERROR": "1"}),
    "no-field": (["train.stepz=3", "hydra.run.dir={tmp}/rejected"], {}),
    "yaml": (["hydra.searchpath=[file://{tmp}/myconf]", "train=broken", "hydra.run.dir={tmp}/rejected"], {}),
    "run-dir-not-creatable": (["hydra.run.dir=/proc/pipenas/run"], {}),
    "constraints": ([*TINY_CONV, *TINY, "search.constraints.max_params={least}", "hydra.run.dir={tmp}/rejected"], {}),
    "checkpoints-unreadable": ([*TINY_CONV, *TINY, "hydra.run.dir={tmp}/junk"], {}),
    "tiny": ([*TINY_CONV, *TINY, "hydra.run.dir={tmp}/tiny"], {}),
    "other-settings": ([*TINY_CONV, *TINY, "train.optimizer.lr=0.2", "hydra.run.dir={tmp}/tiny"], {}),
    "nonfinite": ([*DIVERGING, *TINY, "hydra.run.dir={tmp}/diverged"], {}),
    "sigint": ([*TINY_CONV, *TINY], {"PIPENAS_FAULT": "0:6:step:interrupt"}),
    "resume-as-printed": ([], {}),  # the command the case before printed
    "sigterm": ([*TINY_CONV, *TINY, "hydra.run.dir={tmp}/term"], {"PIPENAS_FAULT": "0:3:step:terminate"}),
    "sigterm-in-search": ([*TINY_CONV, *TINY, "hydra.run.dir={tmp}/term"], {"PIPENAS_FAULT": "0:2:evaluate:terminate"}),
    # the last: a second SIGINT during the checkpoint the first one asked for exits at once
    "sigint-twice": ([*TINY_CONV, *TINY, "hydra.run.dir={tmp}/twice"],
                     {"PIPENAS_FAULT": "0:2:step:interrupt,0:3:checkpoint:interrupt"}),
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Result]]:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "myconf" / "train").mkdir(parents=True)
    (tmp / "myconf" / "train" / "broken.yaml").write_text("steps: 10\n  batch_size: [\n")
    (tmp / "errors").mkdir()
    (tmp / "errors" / "README.md").write_text("")
    (tmp / "junk").mkdir()
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (tmp / "junk" / name).write_bytes(b"not a checkpoint")
    least = least_params()
    cases = []
    for name, (args, env) in CASES.items():
        if not name.startswith("readme-error-"):
            args = [a.format(tmp=tmp, least=least - 1) for a in args]
        if name == "resume-as-printed":
            args = ["<printed>"]
        cwd = tmp / "errors" if name.startswith("readme-error-") else tmp
        cases.append(Case(args, str(cwd), env, ends_process=name == "sigint-twice"))
    results = run_cases(cases)
    return tmp, dict(zip(CASES, results))


def one_error(r: Result) -> str:
    """The single line a rejected run prints, after checking that it is all it prints."""
    assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("i", range(len(README_ERRORS)))
def test_the_readme_bad_input_lines(cli: tuple[Path, dict[str, Result]], i: int) -> None:
    tmp, results = cli
    r = results[f"readme-error-{i}"]
    assert r.status == 2, r.stderr
    assert one_error(r) == README_ERRORS[i][1]
    assert [p.name for p in (tmp / "errors").iterdir()] == ["README.md"]  # no run directory


@pytest.mark.parametrize(("case", "message"), [
    ("steps-abc-full-error", "error: train.steps: expected an integer >= 1, found 'abc'"),
    ("no-field", "error: Could not override 'train.stepz'"),
    ("yaml", "myconf/train/broken.yaml, line 2: expected valid YAML, found mapping values are not allowed here "
             "(column 13)"),
    ("run-dir-not-creatable", "error: hydra.run.dir: expected a directory you can write, found "),
    ("constraints", "error: search.constraints.max_params: expected at least"),
])
def test_bad_input_is_one_line_status_2_and_writes_nothing(cli: tuple[Path, dict[str, Result]], case: str,
                                                            message: str) -> None:
    tmp, results = cli
    r = results[case]
    assert r.status == 2, r.stderr
    assert message in one_error(r)
    assert not (tmp / "rejected").exists()


def test_checkpoint_errors_name_both_files_and_the_fields_that_differ(cli: tuple[Path, dict[str, Result]]) -> None:
    tmp, results = cli
    line = one_error(results["checkpoints-unreadable"])
    assert results["checkpoints-unreadable"].status == 2
    assert f"{tmp}/junk/checkpoint.pt: expected a file written by torch.save" in line
    assert f"{tmp}/junk/checkpoint.prev.pt: expected a file written by torch.save" in line
    assert "to start afresh move both away, or set resume=false" in line
    assert sorted(p.name for p in (tmp / "junk").iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]  # untouched

    assert results["tiny"].status == 0
    refused = results["other-settings"]
    line = one_error(refused)
    assert refused.status == 2 and "train.optimizer.lr (0.1 -> 0.2)" in line and "resume=false" in line
    saved = json.loads((tmp / "tiny" / "summary.json").read_text())
    assert "lr: 0.1" in (tmp / "tiny" / ".hydra" / "config.yaml").read_text()  # the refused run wrote nothing
    assert load_checkpoint(tmp / "tiny" / "checkpoint.pt").step == 12 and saved["resumed_from_step"] == 0


def test_a_failure_while_running_exits_1(cli: tuple[Path, dict[str, Result]]) -> None:
    _, results = cli
    r = results["nonfinite"]
    assert r.status == 1 and "Traceback" not in r.stderr and "best arch" not in r.stdout
    assert len(r.errors) == 1 and r.errors[0].startswith("error: step 7: the loss is nan at micro-batch 1"), r.stderr
    assert "\r" not in r.stderr and "step/s" not in r.stderr  # off a terminal: no progress-bar fragments


def test_sigint_and_sigterm_save_a_checkpoint_and_say_how_to_resume(cli: tuple[Path, dict[str, Result]]) -> None:
    tmp, results = cli
    r = results["sigint"]
    assert r.status == 130, r.stderr
    (line,) = r.errors
    m = re.fullmatch(r"interrupted: SIGINT: stopped after step 7 of 12; checkpoint (\S+)/checkpoint.pt \(step 7\); "
                     r"to resume: (python -m search .*)", line)
    assert m, line
    run_dir = tmp / m.group(1)
    assert m.group(2) == shlex.join(["python", "-m", "search", *CASES["sigint"][0], f"hydra.run.dir={m.group(1)}"])
    resumed = results["resume-as-printed"]
    assert resumed.status == 0, resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    uninterrupted = json.loads((tmp / "tiny" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 7 and summary["params_digest"] == uninterrupted["params_digest"]

    term = results["sigterm"]
    assert term.status == 143, term.stderr
    assert term.errors[0].startswith("interrupted: SIGTERM: stopped after step 4 of 12; checkpoint ")
    # the same command again trains on, then stops in the search after the arch being scored
    searching = results["sigterm-in-search"]
    assert searching.status == 143, searching.stderr
    args = [a.format(tmp=tmp) for a in CASES["sigterm"][0]]
    assert searching.errors == [
        f"interrupted: SIGTERM: stopped the search after 3 of 8 archs; training is complete: checkpoint "
        f"{tmp}/term/checkpoint.pt (step 12); to resume: {shlex.join(['python', '-m', 'search', *args])}"]
    assert load_checkpoint(tmp / "term" / "checkpoint.pt").step == 12 and not (tmp / "term" / "summary.json").exists()


def test_a_second_sigint_exits_at_once_and_leaves_whole_files(cli: tuple[Path, dict[str, Result]]) -> None:
    tmp, results = cli
    r = results["sigint-twice"]
    assert r.status == 130
    assert "interrupted: SIGINT again: exited at once; the files on disk are whole (completed the write of " \
           f"{tmp}/twice/checkpoint.pt)" in r.stderr, r.stderr
    assert sorted(p.name for p in (tmp / "twice").iterdir() if p.name.startswith(".checkpoint")) == []
    assert load_checkpoint(tmp / "twice" / "checkpoint.pt").step == 3
    resumed = run(make_cfg(), output_dir=tmp / "twice")
    uninterrupted = json.loads((tmp / "tiny" / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 3 and resumed["params_digest"] == uninterrupted["params_digest"]


def test_the_readme_example_in_one_process(cli: tuple[Path, dict[str, Result]]) -> None:
    tmp, results = cli
    r = results["readme"]
    assert r.status == 0, r.stderr
    printed = shown(r.stdout)
    out = tmp / printed[-1].removeprefix("output dir: ")
    summary = json.loads((out / "summary.json").read_text())
    assert printed[0] == f"best arch: {json.dumps(summary['best']['arch'], sort_keys=True)}"
    assert (out / "search.log").exists() and (out / ".hydra" / "config.yaml").exists() and (out / "trace.json").exists()
    assert printed[1] == f"val accuracy: {summary['best']['val_accuracy']:.4f} (params {summary['best']['params']}, " \
                         f"flops {summary['best']['flops']})"
    # the README's figures come from one machine; float kernels differ between CPUs, so what
    # must hold anywhere is the lines' form (the numbers: torchrun against one process, below)
    assert same_form(printed, ONE_OUT) and printed[-1] == ONE_OUT[-1]
    assert same_form([f'  "params_digest": "{summary["params_digest"]}",'], GREP_OUT[1:])


@pytest.mark.dist
def test_torchrun_restarts_after_kills_stops_on_sigint_and_resumes(cli: tuple[Path, dict[str, Result]],
                                                                  tmp_path: Path) -> None:
    """The README's torchrun command, with three restarts allowed: rank 1 is killed during a step
    (attempt 0; the survivor names rank, step and action and exits: no hang), rank 0 while
    writing the checkpoint of step 20 (attempt 1: the latest is gone, the one before stays),
    rank 1 while migrating (attempt 2); attempt 3 gets a Ctrl-C (SIGINT to torchrun's agent) and
    stops with a checkpoint; the same command again finishes it."""
    tmp_cli, results = cli
    env = child_env()
    args = TORCHRUN_CMD[TORCHRUN_CMD.index("search") + 1:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "search", *args]
    faults = "1:5:1F1:kill:0,0:20:checkpoint:kill:1,1:23:migrate:kill:2,0:25:step:interrupt:3"
    first = subprocess.run([*cmd[:4], "--max-restarts=3", *cmd[4:]], cwd=tmp_path, env=dict(env, PIPENAS_FAULT=faults),
                           capture_output=True, text=True, timeout=500)
    assert first.returncode != 0  # torchrun reports the signal it got
    err = first.stdout + first.stderr  # rank 0 logs to stdout (Hydra's console), the others to stderr
    for attempt in (1, 2, 3):
        assert f"restart {attempt} of this torchrun job" in err, err[-4000:]
    # every survivor reported an error and exited (no hang: torchrun restarted the job); killed
    # mid-step, the peer's report names rank, step and action, and the lost peer whether gloo
    # noticed it in a wait or already when a send or receive was posted
    assert len(re.findall(r"^error: ", err, re.M)) >= 3, err[-4000:]
    assert re.search(r"^error: rank 0 \(stage 0\) failed at step 5 during \S+: PeerError: (receiving from|sending to) "
                     r"rank 1 failed", err, re.M), err[-4000:]
    assert "no latest checkpoint" in err and "resuming from the previous one" in err  # the write cut short
    (line,) = [ln for ln in err.splitlines() if ln.startswith("interrupted:")]
    m = re.fullmatch(r"interrupted: SIGINT: stopped after step (\d+) of 40; checkpoint (\S+)/checkpoint.pt "
                     r"\(step \d+\); to resume, run the same torchrun command again \(it continues from \S+\)", line)
    assert m, line
    stopped, run_dir = int(m.group(1)), tmp_path / m.group(2)
    assert run_dir.name == torchrun_argv(["search", *args], {"WORLD_SIZE": "2"})[-1].rsplit("/", 1)[1]
    assert 25 < stopped < 35 and load_checkpoint(run_dir / "checkpoint.pt").step == stopped

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    one_dir = shown(results["readme"].stdout)[-1].removeprefix("output dir: ")
    one = json.loads((tmp_cli / one_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped and summary["world_size"] == 2
    assert summary["params_digest"] == one["params_digest"] and summary["top_k"] == one["top_k"]
    digest_line = f'  "params_digest": "{summary["params_digest"]}",'
    if UPDATE:
        update_readme([(TORCHRUN_CMD, shown(again.stdout)), (ONE_CMD, shown(results["readme"].stdout)),
                       (["grep", "-h", "params_digest", f"{m.group(2)}/summary.json", f"{one_dir}/summary.json"],
                        [digest_line] * 2)])
    (_, _, grep_cmd), (torchrun_out, _, grep_out) = readme_example()
    # the same arch and accuracy as one process on this machine, printed as the README shows
    assert shown(again.stdout)[:2] == shown(results["readme"].stdout)[:2]
    assert same_form(shown(again.stdout), torchrun_out) and shown(again.stdout)[-1] == torchrun_out[-1]
    assert same_form([digest_line] * 2, grep_out) and grep_cmd[3] == f"{m.group(2)}/summary.json"
    spans = spans_from_chrome(json.loads((run_dir / "trace.json").read_text()))  # every rank's, on one file
    assert {s.rank for s in spans} == {0, 1}
    check_trace(spans)
    assert sorted(p.name for p in run_dir.iterdir() if not p.is_dir()) == [
        "checkpoint.prev.pt", "checkpoint.pt", "costs.json", "metrics.csv", "metrics.jsonl", "search-evolution.jsonl",
        "search.log", "summary.json", "trace.json"]  # costs.json: the window was chosen (pipeline.window=auto)
    assert [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())] == list(range(40))
