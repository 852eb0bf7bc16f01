"""The run configuration: one frozen dataclass per config group, validated from the DictConfig.

``load_config(cfg)`` reads the composed Hydra config (``conf/config.yaml`` and its groups)
into a :class:`RunConfig` and raises :class:`ConfigError` naming the field, what was expected
and what was found (``train.microbatches: expected a divisor of train.batch_size (64), found
3``). The ``space`` and ``data`` groups name a ``_target_`` (any importable callable) and its
options; :func:`build_space` and :func:`build_data` instantiate them and turn import errors,
unknown options and bad values into the same one-line errors. Options arrive as plain values: a
nested ``_target_`` mapping is passed as a mapping (not built), for the callable to build.

``search.algorithm``: ``evolution``, ``random`` (its baseline at the same budget) or ``none``
(``conf/search/none.yaml``: train and checkpoint only; the population fields are unused). The
``fixed`` sampler (``conf/sampler/fixed.yaml``) trains ``sampler.arch`` every step; without one it
is a one-line error naming ``sampler.arch``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from pipeline import LrSchedule, MemorySettings, OptimConfig, PipelineSettings
from pipeline.combinations import CombinationError, check as check_combination
from supernet import SupernetError, SupernetGraph, build_op

from .data import Dataset
from .evolution import Constraints
from .metrics import tensorboard_available
from .samplers import ORDERS, SAMPLERS, SamplerError, check_order

__all__ = [
    "ConfigError", "TargetConfig", "TrainConfig", "SamplerConfig", "SearchConfig", "RunConfig",
    "load_config", "build_space", "build_data", "config_digest", "train_digest", "train_fields", "field_differences",
]

OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("constant", "cosine")
ALGORITHMS = ("evolution", "random", "none")  # none: train only, no search
NONFINITE = ("stop", "skip")
_HYDRA_KEYS = ("_target_", "_args_", "_recursive_", "_convert_", "_partial_")


class ConfigError(ValueError):
    """The config is malformed: a field is missing, unknown, of the wrong type or out of range."""


# -- the groups ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TargetConfig:
    """A group that names a callable: ``space`` and ``data``."""

    group: str
    target: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int
    microbatches: int
    optimizer: OptimConfig
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0
    checkpoint_every: int = 0  # 0: only at the end
    log_every: int = 50
    nonfinite: str = "stop"  # a step whose loss is not finite: stop the run, or skip (no update)
    # a run directory (its checkpoint.pt) or checkpoint file whose op weights and buffers a run that
    # starts afresh begins from, with a fresh optimizer (fine-tuning); null: the seeded init
    init_from: str | None = None
    # clip each subnet's gradients to this global L2 norm before its update, the same bits in every
    # layout (pipeline.engine.GradClip); null: off. Flushed steps only (pipeline.window 1, exact shared ops)
    clip_grad_norm: float | None = None
    # what is recorded while training (search/metrics.py; not in the train digest)
    tensorboard: str | bool = "auto"  # TensorBoard scalars in <run dir>/tb: auto (when installed) | true | false
    monitor_every: int = 200  # steps between scorings of the reference subnets; 0: never
    monitor_archs: tuple[dict[str, Any], ...] | None = None  # null: the smallest, a middle and the largest
    monitor_samples: int | None = None  # score on the first this many validation samples; null: all (as the search)

    def schedule(self) -> LrSchedule:
        return LrSchedule(self.optimizer.lr, self.steps, self.lr_schedule, self.warmup_steps, self.min_lr)


@dataclass(frozen=True)
class SamplerConfig:
    name: str
    arch: dict[str, Any] | None = None  # the fixed sampler's arch
    order: str = "stream"  # or "locality": each fair round / block of draws reordered for op reuse
    block: int | None = None  # uniform with order=locality: draws per block (null: as many as a fair round)


@dataclass(frozen=True)
class SearchConfig:
    algorithm: str  # evolution | random | none (train only: population and generations unused)
    population: int
    generations: int
    mutate_prob: float
    crossover_prob: float
    parents: int | None
    top_k: int
    constraints: Constraints
    val_batch_size: int
    bn_calib_batches: int
    calib_batch_size: int
    seed_archs: tuple[dict[str, Any], ...] = ()
    seed: int | None = None  # the search's own random stream; None: derived from the run's seed
    # under torchrun, score each batch of archs on every process (search/parallel.py): auto | true | false
    parallel: bool | str = "auto"

    @property
    def budget(self) -> int:
        """Distinct archs scored: the same for evolution and its random-search baseline (0 for none)."""
        return 0 if self.algorithm == "none" else self.population * self.generations


@dataclass(frozen=True)
class RunConfig:
    seed: int
    device: str
    threads: int | None
    output_dir: str | None
    resume: bool
    space: TargetConfig
    data: TargetConfig
    sampler: SamplerConfig
    train: TrainConfig
    search: SearchConfig
    pipeline: PipelineSettings
    memory: MemorySettings = MemorySettings()
    deterministic: bool = True
    keep_host_memory: bool = True  # glibc's malloc keeps freed memory (pipeline/malloc.py)


# -- reading ---------------------------------------------------------------------------------

_MISSING = object()


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


class _Group:
    """Typed reads from one mapping; remembers what was read so leftovers can be reported."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: expected a mapping of fields, found {_type_name(data)} {data!r}")
        self.data, self.path, self.read = data, path, set()

    def where(self, key: str) -> str:
        """The dotted path of ``key`` (``train.steps``; a top-level field is just its name)."""
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str, default: Any) -> Any:
        self.read.add(key)
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise ConfigError(f"{self.where(key)}: missing; this field is required")
        return default

    def fail(self, key: str, expected: str, found: Any) -> ConfigError:
        return ConfigError(f"{self.where(key)}: expected {expected}, found {found!r}")

    def int(self, key: str, default: Any = _MISSING, minimum: int | None = None, optional: bool = False) -> Any:
        v = self._get(key, default)
        if v is None and optional:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or (minimum is not None and v < minimum):
            what = "an integer" + (f" >= {minimum}" if minimum is not None else "") + (" or null" if optional else "")
            raise self.fail(key, what, v)
        return v

    def float(self, key: str, default: Any = _MISSING, lo: float | None = None, hi: float | None = None,
              positive: bool = False) -> float:
        v = self._get(key, default)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (lo is None or v >= lo) and (hi is None or v <= hi) and (not positive or v > 0)
        if not ok:
            if positive:
                what = "a positive number"
            elif lo is not None and hi is not None:
                what = f"a number in [{lo}, {hi}]"
            else:
                what = "a number" + (f" >= {lo}" if lo is not None else "")
            raise self.fail(key, what, v)
        return float(v)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise self.fail(key, "true or false", v)
        return v

    def choice(self, key: str, options: Sequence[str], default: Any = _MISSING) -> str:
        v = self._get(key, default)
        if v not in options:
            raise self.fail(key, f"one of {list(options)}", v)
        return v

    def str(self, key: str, default: Any = _MISSING, optional: bool = False) -> Any:
        v = self._get(key, default)
        if v is None and optional:
            return None
        if not isinstance(v, str) or not v:
            raise self.fail(key, "a non-empty string" + (" or null" if optional else ""), v)
        return v

    def group(self, key: str, default: Any = _MISSING) -> _Group:
        return _Group(self._get(key, default), self.where(key))

    def done(self, ignore: Sequence[str] = ()) -> None:
        extra = sorted(k for k in self.data if k not in self.read and k not in ignore)
        if extra:
            known = sorted(self.read)
            raise ConfigError(f"{self.where(extra[0])}: unknown field; expected one of {known}")


def _to_container(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(cfg, DictConfig):
        try:
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
        except Exception as e:  # interpolation errors name the key themselves
            raise ConfigError(f"config: cannot resolve it: {_one_line(str(e))}") from None
    return dict(cfg)


def _target(root: _Group, group: str) -> TargetConfig:
    g = root.group(group)
    target = g.data.get("_target_")
    if not isinstance(target, str) or not target:
        raise ConfigError(
            f"{group}._target_: expected a dotted path to a callable (e.g. "
            f"{'supernet.spaces.conv.build' if group == 'space' else 'search.data.Digits'}), found {target!r}"
        )
    for key in ("_args_", "_partial_"):
        if key in g.data:
            raise ConfigError(f"{group}.{key}: not supported here; give options by name")
    options = {k: v for k, v in g.data.items() if k not in _HYDRA_KEYS}
    return TargetConfig(group, target, options)


def _train(root: _Group) -> TrainConfig:
    g = root.group("train")
    steps = g.int("steps", minimum=1)
    batch = g.int("batch_size", minimum=1)
    micro = g.int("microbatches", minimum=1)
    if batch % micro:
        raise ConfigError(f"train.microbatches: expected a divisor of train.batch_size ({batch}), found {micro}")
    o = g.group("optimizer")
    name = o.choice("name", OPTIMIZERS)
    betas = o._get("betas", [0.9, 0.999])
    if (not isinstance(betas, (list, tuple)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise o.fail("betas", "two numbers in [0, 1)", betas)
    optim = OptimConfig(
        name=name, lr=o.float("lr", positive=True), momentum=o.float("momentum", 0.9, 0.0, 1.0),
        weight_decay=o.float("weight_decay", 0.0, lo=0.0), betas=(float(betas[0]), float(betas[1])),
        eps=o.float("eps", 1e-8, positive=True), nesterov=o.bool("nesterov", False),
    )
    if optim.nesterov and name == "sgd" and optim.momentum == 0:
        raise ConfigError("train.optimizer.nesterov: expected false when momentum is 0 (torch requires momentum > 0)")
    o.done()
    warmup = g.int("warmup_steps", 0, minimum=0)
    if warmup > steps:
        raise ConfigError(f"train.warmup_steps: expected at most train.steps ({steps}), found {warmup}")
    cfg = TrainConfig(
        steps=steps, batch_size=batch, microbatches=micro, optimizer=optim,
        lr_schedule=g.choice("lr_schedule", LR_SCHEDULES, "cosine"), warmup_steps=warmup,
        min_lr=g.float("min_lr", 0.0, lo=0.0), checkpoint_every=g.int("checkpoint_every", 0, minimum=0),
        log_every=g.int("log_every", 50, minimum=1), nonfinite=g.choice("nonfinite", NONFINITE, "stop"),
        tensorboard=_tensorboard(g), monitor_every=g.int("monitor_every", 200, minimum=0),
        monitor_archs=_monitor_archs(g), monitor_samples=g.int("monitor_samples", None, minimum=1, optional=True),
        init_from=g.str("init_from", None, optional=True),
        clip_grad_norm=None if g._get("clip_grad_norm", None) is None else g.float("clip_grad_norm", positive=True),
    )
    g.done()
    return cfg


def _tensorboard(g: _Group) -> str | bool:
    v = g._get("tensorboard", "auto")
    if v not in ("auto", True, False) or isinstance(v, (int, float)) and not isinstance(v, bool):  # 1 == True
        raise g.fail("tensorboard", "auto, true or false", v)
    if v is True and not tensorboard_available():
        raise ConfigError("train.tensorboard: expected the tensorboard package with true, found it not installed; "
                          "pip install 'pipenas[tensorboard]' (or tensorboard), or train.tensorboard=auto")
    return v


def _monitor_archs(g: _Group) -> tuple[dict[str, Any], ...] | None:
    archs = g._get("monitor_archs", None)
    if archs is None:
        return None
    if not isinstance(archs, list) or not archs:
        raise g.fail("monitor_archs", "a non-empty list of archs (label -> value mappings) or null", archs)
    for i, a in enumerate(archs):
        if not isinstance(a, Mapping):
            raise ConfigError(f"train.monitor_archs[{i}]: expected a mapping label -> value, found {a!r}")
    return tuple(dict(a) for a in archs)


def _search(root: _Group) -> SearchConfig:
    g = root.group("search")
    c = g.group("constraints", {})
    constraints = Constraints(c.int("max_params", None, minimum=1, optional=True),
                              c.int("max_flops", None, minimum=1, optional=True))
    c.done()
    seed_archs = g._get("seed_archs", [])
    if not isinstance(seed_archs, list):
        raise g.fail("seed_archs", "a list of archs (label -> value mappings)", seed_archs)
    for i, a in enumerate(seed_archs):
        if not isinstance(a, Mapping):
            raise ConfigError(f"search.seed_archs[{i}]: expected a mapping label -> value, found {a!r}")
    algorithm = g.choice("algorithm", ALGORITHMS)
    required = _MISSING if algorithm != "none" else None  # search=none: no population to breed
    population = g.int("population", required, minimum=2, optional=algorithm == "none")
    generations = g.int("generations", required, minimum=1, optional=algorithm == "none")
    cfg = SearchConfig(
        algorithm=algorithm, population=population or 0, generations=generations or 0,
        mutate_prob=g.float("mutate_prob", 0.1, 0.0, 1.0),
        crossover_prob=g.float("crossover_prob", 0.5, 0.0, 1.0),
        parents=g.int("parents", None, minimum=1, optional=True), top_k=g.int("top_k", 5, minimum=1),
        constraints=constraints, val_batch_size=g.int("val_batch_size", 256, minimum=1),
        bn_calib_batches=g.int("bn_calib_batches", 4, minimum=0),
        calib_batch_size=g.int("calib_batch_size", 64, minimum=1),
        seed_archs=tuple(dict(a) for a in seed_archs), seed=g.int("seed", None, minimum=0, optional=True),
        parallel=_parallel(g),
    )
    g.done()
    return cfg


def _parallel(g: _Group) -> str | bool:
    v = g._get("parallel", "auto")
    if v not in ("auto", True, False) or isinstance(v, (int, float)) and not isinstance(v, bool):  # 1 == True
        raise g.fail("parallel", "auto, true or false (under torchrun: score each batch of archs on every "
                                 "process)", v)
    return v


def _sampler(root: _Group) -> SamplerConfig:
    g = root.group("sampler")
    arch = g._get("arch", None)
    if arch is not None and not isinstance(arch, Mapping):
        raise g.fail("arch", "a mapping label -> value or null", arch)
    name = g.choice("name", sorted(SAMPLERS))
    if name == "fixed" and arch is None:
        raise ConfigError("sampler.arch: expected the arch the fixed sampler trains, a mapping label -> value "
                          "(e.g. sampler.arch='{layer00: k3e3, layer01: k5e6, ...}'), found null")
    cfg = SamplerConfig(name, None if arch is None else dict(arch),
                        g.choice("order", ORDERS, "stream"), g.int("block", None, minimum=2, optional=True))
    try:
        check_order(cfg.name, cfg.order, cfg.block)
    except SamplerError as e:
        raise ConfigError(str(e)) from None
    g.done()
    return cfg


def _pipeline(root: _Group) -> PipelineSettings:
    g = root.group("pipeline")
    names = [f.name for f in dataclasses.fields(PipelineSettings)]
    for k in g.data:
        if k not in names:
            raise ConfigError(f"pipeline.{k}: unknown field; expected one of {names}")
    try:
        return PipelineSettings(**g.data)
    except (ValueError, TypeError) as e:
        raise ConfigError(_one_line(str(e))) from None


def _memory(root: _Group) -> MemorySettings:
    g = root.group("memory", {})
    names = [f.name for f in dataclasses.fields(MemorySettings)]
    for k in g.data:
        if k not in names:
            raise ConfigError(f"memory.{k}: unknown field; expected one of {names}")
    for key in ("device_budget_bytes", "activation_budget_bytes"):
        budget = g.data.get(key)
        if isinstance(budget, float) and budget.is_integer():  # 1.0e+9 in YAML
            g.data = {**g.data, key: int(budget)}
    try:
        return MemorySettings(**g.data)
    except (ValueError, TypeError) as e:
        raise ConfigError(_one_line(str(e))) from None


def load_config(cfg: DictConfig | Mapping[str, Any]) -> RunConfig:
    """Validate the composed config and read it into a :class:`RunConfig`."""
    root = _Group(_to_container(cfg), "")
    device = root.str("device", "auto")
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise root.fail("device", "'auto', 'cpu', 'cuda' or 'cuda:<index>'", device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {device!r} was asked for but torch sees no CUDA device; use device=auto or cpu")
    seed = root.int("seed", minimum=0)
    threads = root.int("threads", None, minimum=1, optional=True)
    output_dir = root.str("output_dir", None, optional=True)
    resume = root.bool("resume", True)
    deterministic = root.bool("deterministic", True)
    keep_host_memory = root.bool("keep_host_memory", True)
    space, data = _target(root, "space"), _target(root, "data")
    sampler = _sampler(root)
    run = RunConfig(seed=seed, device=device, threads=threads, output_dir=output_dir, resume=resume,
                    space=space, data=data, sampler=sampler, train=_train(root), search=_search(root),
                    pipeline=_pipeline(root), memory=_memory(root), deterministic=deterministic,
                    keep_host_memory=keep_host_memory)
    late = [s for s in run.pipeline.trace_steps if s >= run.train.steps]
    if late:
        raise ConfigError(f"pipeline.trace_steps: expected steps below train.steps ({run.train.steps}), found {late}")
    try:  # the one table of what does not combine (pipeline/combinations.py)
        check_combination(run.pipeline, run.memory, run.train.clip_grad_norm, _world_size())
    except CombinationError as e:
        raise ConfigError(str(e)) from None
    root.done(ignore=("hydra",))
    return run


def _world_size() -> int:
    """The processes of this run: torchrun's ``WORLD_SIZE`` (1 outside torchrun or when unreadable:
    the launcher's own checks name it)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


# -- instantiating targets -------------------------------------------------------------------

def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.strip().splitlines() if part.strip())


def _instantiate(tc: TargetConfig, provided: Mapping[str, Any]) -> Any:
    """Call ``tc.target(**tc.options, **provided)`` through Hydra, with one-line errors."""
    from hydra.errors import InstantiationException
    from hydra.utils import get_object, instantiate

    where = f"{tc.group}._target_"
    hydra_log = logging.getLogger("hydra.utils")  # logs the failed import over several ERROR lines first
    quiet, hydra_log.disabled = hydra_log.disabled, True
    try:
        fn = get_object(tc.target)
    except Exception as e:
        cause = e.__cause__ or e
        raise ConfigError(f"{where}: cannot import {tc.target!r} ({_one_line(str(cause)) or type(cause).__name__})") from None
    finally:
        hydra_log.disabled = quiet
    if not callable(fn):
        raise ConfigError(f"{where}: expected a callable, found {type(fn).__name__} at {tc.target!r}")
    for key in provided:
        if key in tc.options:
            raise ConfigError(f"{tc.group}.{key}: set by the run itself (from the data); remove it from the config")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        accepted = [n for n, p in sig.parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for key in provided:
            if key not in accepted:
                raise ConfigError(f"{where}: {tc.target} does not take {key!r}; a {tc.group} callable must "
                                  f"accept {sorted(provided)} by keyword")
        for key in tc.options:
            if key not in accepted:
                options = sorted(set(accepted) - set(provided))
                raise ConfigError(f"{tc.group}.{key}: unknown option for {tc.target}; it accepts {options}")
        for name, p in sig.parameters.items():
            required = p.default is p.empty and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            if required and name not in tc.options and name not in provided:
                raise ConfigError(f"{tc.group}.{name}: missing; {tc.target} requires it")
    # not recursive: a nested ``_target_`` mapping reaches the callable as a mapping, so an adapter
    # (search.torch_data.TorchData) builds its own and its errors name the nested key (data.train.root)
    node = OmegaConf.create({"_target_": tc.target, "_convert_": "all", "_recursive_": False, **tc.options})
    try:
        return instantiate(node, **provided)
    except InstantiationException as e:
        cause = e.__cause__ or e
        if isinstance(cause, (ValueError, TypeError, KeyError)):
            if isinstance(getattr(cause, "option", None), str):  # "root: ..." about one option: data.root
                raise ConfigError(f"{tc.group}.{_one_line(str(cause))}") from None
            raise ConfigError(f"{tc.group} ({tc.target}): {_one_line(str(cause))}") from None
        raise


def build_data(tc: TargetConfig) -> Dataset:
    """Instantiate the dataset and check that it offers what training and search use."""
    data = _instantiate(tc, {})
    missing = [m for m in ("input_shape", "num_classes", "train_batch", "val_batches", "calib_batches")
               if not hasattr(data, m)]
    if missing:
        raise ConfigError(
            f"data._target_: {tc.target} returned a {type(data).__name__} without {missing}; "
            "a dataset offers input_shape, num_classes, train_batch, val_batches and calib_batches"
        )
    return data


def build_space(tc: TargetConfig, input_shape: Sequence[int], num_classes: int) -> SupernetGraph:
    """Instantiate the space's graph for the data's shapes and check every op can be built."""
    graph = _instantiate(tc, {"input_shape": tuple(input_shape), "num_classes": int(num_classes)})
    if not isinstance(graph, SupernetGraph):
        raise ConfigError(f"space._target_: {tc.target} returned {type(graph).__name__}, expected a supernet.SupernetGraph")
    try:
        graph.output  # noqa: B018 - checks there is exactly one output node
        if len(graph.space()) == 0:
            raise ConfigError(f"space ({tc.target}): the supernet has no choice slots; there is nothing to search")
        with torch.device("meta"):  # catches unknown ops and bad op arguments without allocating
            for slot in graph.slots():
                build_op(slot.spec, slot.op_id, 0)
    except SupernetError as e:
        raise ConfigError(f"space ({tc.target}): {_one_line(str(e))}") from None
    return graph


# -- digests ---------------------------------------------------------------------------------

def _digest(data: Any) -> str:
    return hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(data)).encode()).hexdigest()


def config_digest(cfg: DictConfig | Mapping[str, Any]) -> str:
    """sha256 of the resolved config as YAML (Hydra's own settings left out)."""
    data = _to_container(cfg)
    data.pop("hydra", None)
    return _digest(data)


# train fields that only decide what is recorded: a checkpoint resumes with other values
_RECORDING = ("log_every", "tensorboard", "monitor_every", "monitor_archs", "monitor_samples")


def train_fields(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The fields that decide what training computes: seed, space, sampler, data, and train but
    its logging, monitoring and checkpoint cadence and ``nonfinite`` (a checkpoint keeps them)."""
    data = _to_container(cfg)
    pipe = data.get("pipeline") or {}
    mode = pipe.get("shared_ops", "exact")
    # shared ops read late or frozen change what training computes; so does, read late, where the
    # checkpoint boundaries fall (no subnet reads a version from before the last boundary)
    keep = ("checkpoint_every",) if mode == "delayed" else ()
    train = {k: v for k, v in data.get("train", {}).items()
             if k not in ("checkpoint_every", *_RECORDING, "nonfinite") or k in keep}
    for key in ("init_from", "clip_grad_norm"):  # left out when unset: older runs keep their digest
        if train.get(key) is None:
            train.pop(key, None)
    # the stream order at its defaults is left out, so runs from before it was a choice keep their digest
    sampler = data.get("sampler")
    if isinstance(sampler, Mapping):
        sampler = {k: v for k, v in sampler.items() if (k, v) not in (("order", "stream"), ("block", None))}
    fields = {"seed": data.get("seed"), "space": data.get("space"), "sampler": sampler,
              "data": data.get("data"), "train": train}
    if mode != "exact":
        fields["shared_ops"] = {"mode": mode, **({"delay": pipe.get("shared_delay", 1)} if mode == "delayed" else {})}
        delays = dict(pipe.get("shared_delays") or {})
        if mode == "delayed" and delays:  # left out when none: older delayed runs keep their digest
            fields["shared_ops"]["delays"] = dict(sorted(delays.items()))
        rule = pipe.get("delay_compensation", "none")
        if mode == "delayed" and rule != "none":  # left out when off: older delayed runs keep their digest
            fields["shared_ops"]["compensation"] = {"rule": rule, "coef": pipe.get("delay_compensation_coef", 1.0)}
    if pipe.get("reduce", "exact") == "fast":  # replicas' gradients summed in the all-reduce's order
        fields["reduce"] = "fast"
    return fields


def train_digest(cfg: DictConfig | Mapping[str, Any]) -> str:
    """sha256 over :func:`train_fields`. A checkpoint resumes only a run with the same digest;
    search settings, threads, pipeline layout and paths may change, and a run stopped by a
    non-finite loss may resume with ``train.nonfinite=skip``."""
    return _digest(train_fields(cfg))


def field_differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``path (old -> new)`` for every leaf field that differs between two nested mappings."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        path = f"{prefix}{key}"
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += field_differences(a, b, f"{path}.")
        elif a != b:
            show = lambda v: "(unset)" if v is _MISSING else repr(v)  # noqa: E731
            out.append(f"{path} ({show(a)} -> {show(b)})")
    return out
