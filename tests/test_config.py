"""Config: every option of every group composes and instantiates; custom spaces plug in through
``_target_``; malformed configs fail with one line naming the field."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from search.config import (ConfigError, build_data, build_space, config_digest, load_config,
                           train_digest)
from search.samplers import make_sampler
from supernet import SupernetGraph

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
GROUPS = ("space", "sampler", "data", "train", "search", "pipeline")


def make_cfg(*overrides: str, conf: Path = CONF):
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # so that `tests.custom_space` imports


def group_options() -> list[tuple[str, str]]:
    """Every YAML of every config group: a new preset is tested without touching this file."""
    found = [(p.parent.name, p.stem) for p in sorted(CONF.glob("*/*.yaml"))]
    assert set(GROUPS) <= {g for g, _ in found}
    return found


@pytest.mark.parametrize(("group", "option"), group_options())
def test_every_group_option_composes_and_instantiates(group: str, option: str, tmp_path: Path) -> None:
    from search.torch_data import write_digits

    # the fixed sampler trains the arch it is given (none given is an error: tests/test_search_modes.py)
    arch = ["sampler.arch={layer00: k3e3, layer01: k3e6, layer02: k5e3, layer03: k5e6}"] if option == "fixed" else []
    # the on-disk formats read a root of their own: the digits written in that format
    root = ([f"data.root={write_digits(tmp_path / option, option)}"]
            if group == "data" and option in ("image_folder", "cifar10") else [])
    cfg = make_cfg(f"{group}={option}", *arch, *root)
    rc = load_config(cfg)
    data = build_data(rc.data)
    graph = build_space(rc.space, data.input_shape, data.num_classes)
    assert isinstance(graph, SupernetGraph) and graph.space().size() > 1
    sampler = make_sampler(rc.sampler.name, graph.space(), rc.seed, rc.sampler.arch)
    assert graph.space().validate(sampler.next())
    x, y = data.train_batch(0, rc.train.batch_size)
    assert x.shape == (rc.train.batch_size, *data.input_shape) and y.max() < data.num_classes
    assert rc.train.batch_size % rc.train.microbatches == 0


def test_defaults() -> None:
    rc = load_config(make_cfg())
    assert rc.space.target == "supernet.spaces.conv.build" and rc.data.target == "search.data.Digits"
    assert rc.sampler.name == "uniform" and rc.search.algorithm == "evolution"
    assert rc.train.optimizer.name == "sgd" and rc.train.schedule()(rc.train.steps - 1) < rc.train.optimizer.lr
    assert rc.pipeline.schedule == "1f1b" and rc.pipeline.stages == "auto" and rc.pipeline.window == "auto"
    assert rc.seed == 0 and rc.device == "auto" and rc.resume and rc.deterministic and rc.keep_host_memory
    assert load_config(make_cfg("search=random")).search.budget == rc.search.budget


def test_custom_space_through_target_override() -> None:
    cfg = make_cfg("~space", "+space._target_=tests.custom_space.build", "+space.width=8", "+space.layers=3")
    rc = load_config(cfg)
    data = build_data(rc.data)
    graph = build_space(rc.space, data.input_shape, data.num_classes)
    assert graph.name == "custom" and graph.space().labels == ("l0", "l1", "l2")


def test_custom_space_through_a_yaml_on_the_search_path(tmp_path: Path) -> None:
    (tmp_path / "space").mkdir()
    (tmp_path / "space" / "mine.yaml").write_text(
        "_target_: tests.custom_space.build\nwidth: 12\ncandidates: [relu, gelu, skip]\n"
    )
    cfg = make_cfg(f"hydra.searchpath=[file://{tmp_path}]", "space=mine")
    rc = load_config(cfg)
    graph = build_space(rc.space, (1, 8, 8), 10)
    assert graph.space().choice("l0").values == ("relu", "gelu", "skip")


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.microbatches=3"], "train.microbatches: expected a divisor of train.batch_size (64), found 3"),
    (["train.optimizer.name=adam"], "train.optimizer.name: expected one of ['sgd', 'adamw'], found 'adam'"),
    (["train.steps=0"], "train.steps: expected an integer >= 1, found 0"),
    (["train.steps=ten"], "train.steps: expected an integer >= 1, found 'ten'"),
    (["sampler.name=greedy"], "sampler.name: expected one of ['fair', 'fixed', 'uniform'], found 'greedy'"),
    (["train.optimizer.lr=-1"], "train.optimizer.lr: expected a positive number, found -1"),
    (["search.algorithm=annealing"], "search.algorithm: expected one of ['evolution', 'random', 'none'], found 'annealing'"),
    (["search.population=1"], "search.population: expected an integer >= 2, found 1"),
    (["search.constraints.max_params=0"], "search.constraints.max_params: expected an integer >= 1 or null, found 0"),
    (["search.seed_archs=[3]"], "search.seed_archs[0]: expected a mapping label -> value, found 3"),
    (["pipeline.schedule=zigzag"], "pipeline.schedule: expected one of ['gpipe', '1f1b', 'zbh1'], found 'zigzag'"),
    (["device=tpu"], "device: expected 'auto', 'cpu', 'cuda' or 'cuda:<index>', found 'tpu'"),
    (["seed=-1"], "seed: expected an integer >= 0, found -1"),
    (["+train.stepz=5"], "train.stepz: unknown field; expected one of"),
    (["+pipeline.depth=2"], "pipeline.depth: unknown field; expected one of"),
    (["pipeline.trace_steps=[2,-1]"], "pipeline.trace_steps: expected a list of step indices (integers >= 0), found [2, -1]"),
    (["pipeline.trace_steps=3"], "pipeline.trace_steps: expected a list of step indices (integers >= 0), found 3"),
    (["train.steps=10", "pipeline.trace_steps=[3,10]"], "pipeline.trace_steps: expected steps below train.steps (10), found [10]"),
    (["train.nonfinite=ignore"], "train.nonfinite: expected one of ['stop', 'skip'], found 'ignore'"),
    (["deterministic=sometimes"], "deterministic: expected true or false, found 'sometimes'"),
    (["keep_host_memory=1GB"], "keep_host_memory: expected true or false, found '1GB'"),
])
def test_malformed_config_names_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(make_cfg(*overrides))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("overrides", "message"), [
    (["space._target_=supernet.spaces.nonexistent.build"],
     "space._target_: cannot import 'supernet.spaces.nonexistent.build'"),
    (["space._target_=supernet.spaces.conv.SPACE_CONSTANT_THAT_IS_NOT_THERE"], "space._target_: cannot import"),
    (["+space.depth=3"], "space (supernet.spaces.conv.build): conv: unknown option 'depth'"),
    (["space.kernels=[4]"], "conv.kernels: expected odd kernel sizes"),
    (["~space", "+space._target_=tests.custom_space.build", "+space.op=no_such_op"],
     "unknown op kind 'no_such_op'"),
    (["~space", "+space._target_=tests.custom_space.build", "+space.depth=2"],
     "space.depth: unknown option for tests.custom_space.build; it accepts ['candidates', 'layers', 'op', 'width']"),
    (["~space", "+space._target_=tests.custom_space.build", "+space.num_classes=3"],
     "space.num_classes: set by the run itself"),
    (["~space", "+space._target_=search.data.Digits"],
     "space._target_: search.data.Digits does not take 'input_shape'; a space callable must accept"),
    (["~space", "+space._target_=builtins.dict"], "space._target_: builtins.dict returned dict, expected a supernet.SupernetGraph"),
])
def test_bad_space_names_the_target_or_option(overrides: list[str], message: str) -> None:
    rc = load_config(make_cfg(*overrides))
    with pytest.raises(ConfigError) as e:
        build_space(rc.space, (1, 8, 8), 10)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_data_target_and_option() -> None:
    with pytest.raises(ConfigError, match="data._target_: cannot import 'search.data.Nope'"):
        build_data(load_config(make_cfg("data._target_=search.data.Nope")).data)
    with pytest.raises(ConfigError, match="data.colour: unknown option for search.data.Digits"):
        build_data(load_config(make_cfg("+data.colour=red")).data)
    with pytest.raises(ConfigError, match=r"data \(search.data.Synthetic\): data.num_classes: expected an integer >= 2"):
        build_data(load_config(make_cfg("data=synthetic", "data.num_classes=1")).data)


def test_digests() -> None:
    base = make_cfg()
    assert config_digest(base) == config_digest(make_cfg())
    assert len(config_digest(base)) == 64
    same_training = make_cfg("search=random", "threads=1", "train.checkpoint_every=7", "pipeline.schedule=gpipe")
    assert train_digest(same_training) == train_digest(base)
    assert config_digest(same_training) != config_digest(base)
    for change in ("seed=1", "train.optimizer.lr=0.2", "sampler=fair", "space.layers=3", "train.steps=10"):
        assert train_digest(make_cfg(change)) != train_digest(base), change
