"""The virtualized tensor manager: a budget that forces evictions every step computes the same
bits as all-resident, the device tier never holds more than the budget, and only dirty ops are
written back."""
from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch
from torch import nn

from distributed import arch_stream, build_graph, step_data
from pipeline import LrSchedule, MemoryBudgetError, MemorySettings, OptimConfig, ReferenceEngine, params_digest
from pipeline.memory import TensorManager
from pipeline.memory.arena import Arena
from pipeline.memory.state import OpLayout
from supernet import OpContext, OpSpec, SupernetGraph

STEPS = 5


def optim_of(name: str) -> OptimConfig:
    return OptimConfig(name=name, lr=0.05 if name == "sgd" else 3e-3, momentum=0.9, weight_decay=1e-4, nesterov=True)


def run(space: str, optim: str, memory: MemorySettings | None, steps: int = STEPS, audit: bool = False,
        shared_ops: str = "exact") -> dict:
    """Train ``steps`` steps through the reference engine as the app does (lookahead of 2),
    evaluate one arch; with ``audit`` check the device tier inside every step and after it."""
    graph = build_graph(space)
    engine = ReferenceEngine(graph, 0, optim_of(optim), 4, LrSchedule(optim_of(optim).lr, steps, "cosine", 1),
                             "cpu", memory=memory, shared_ops=shared_ops)
    archs = arch_stream(graph, 0, steps + 1)
    tm = engine.tensors
    audits, steps_stats = [], []
    if audit:
        real_step = tm.step

        def audited_step(op_ids, lr):  # after the backward, before the update: the step's peak
            audits.append(tm.audit())
            real_step(op_ids, lr)

        tm.step = audited_step
    losses, mb = [], []
    for s in range(steps):
        x, y = step_data(0, s, 16)
        engine.plan_ahead(archs[s + 1 : s + 3])
        r = engine.train_step(s, archs[s], x, y)
        losses.append(r.loss)
        mb.append(r.microbatch_losses)
        steps_stats.append(r.memory)
        if audit:
            audits.append(tm.audit())
    xv, yv = step_data(7, 0, 16)
    ev = engine.evaluate(archs[steps], [(xv, yv)], [step_data(9, 0, 16)])
    out = {"losses": losses, "mb": mb, "eval": (ev.loss, ev.correct), "digest": params_digest(engine.op_states()),
           "stats": tm.stats(), "steps": steps_stats, "audits": audits}
    engine.close()
    return out


@functools.cache
def reference(space: str, optim: str) -> dict:
    """The all-resident run (run once per space and optimizer: the tests only read it)."""
    return run(space, optim, None)


def tight_budget(space: str, optim: str, steps: int = STEPS, optimizer: str = "device", device: str = "cpu") -> int:
    """The smallest budget this run can use: the largest footprint of its steps' subnets (with
    the optimizer state on the device unless ``optimizer`` says otherwise; ``device``'s alignment)."""
    graph = build_graph(space)
    tm = TensorManager(graph, 0, optim_of(optim), device, memory=MemorySettings(optimizer=optimizer))
    return max(tm.footprint(op.op_id for op in graph.active_ops(a)) for a in arch_stream(graph, 0, steps + 1))


@pytest.fixture
def no_static_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let tests use the tightest budget of their own runs (below the largest possible subnet)."""
    monkeypatch.setattr(ReferenceEngine, "_check_budget", lambda self: None)


@pytest.mark.parametrize("space", ["transformer", "conv", "cell"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_a_budget_that_forces_evictions_computes_the_same_bits(space: str, optim: str, no_static_check) -> None:
    budget = tight_budget(space, optim)
    ref = reference(space, optim)
    # copies on the background thread: the CUDA side stream's control flow (the default is inline)
    got = run(space, optim, MemorySettings(device_budget_bytes=budget, optimizer="device", cpu_copies="thread"),
              audit=True)
    for key in ("losses", "mb", "eval", "digest"):
        assert got[key] == ref[key], f"{space}/{optim}: {key} differs with the manager"
    assert all(st.evictions > 0 for st in got["steps"][1:]), f"{space}/{optim}: the budget should force evictions"
    assert got["stats"].resident_bytes_peak <= budget
    for st in got["steps"]:
        assert st.resident_bytes_peak <= budget and st.budget_bytes == budget
    assert len(got["audits"]) == 2 * STEPS
    for a in got["audits"]:  # the independent count: tensors whose storage is the arena
        assert a.capacity == budget and not a.stray, a.stray
        assert 0 < a.arena_tensor_bytes <= a.arena_region_bytes <= budget


@pytest.mark.parametrize("space, optim", [("transformer", "adamw"), ("conv", "sgd"), ("cell", "adamw")])
def test_the_host_updated_optimizer_computes_the_same_bits(space: str, optim: str, no_static_check) -> None:
    """Optimizer state in host memory, updated there: only weights and buffers take device
    room, every used op leaves the device after its step, and the bits do not change."""
    ref = reference(space, optim)
    device_only = tight_budget(space, optim)
    mem = MemorySettings(device_budget_bytes=device_only, optimizer="host", cpu_copies="thread")
    got = run(space, optim, mem, audit=True)
    for key in ("losses", "mb", "eval", "digest"):
        assert got[key] == ref[key], f"{space}/{optim}: {key} differs with the host-updated optimizer"
    for a in got["audits"]:
        assert not a.stray, a.stray
    assert got["stats"].resident_bytes_peak < device_only  # the optimizer state takes no device room
    assert all(st.evictions >= 1 for st in got["steps"])  # the step's ops leave the device


@pytest.mark.parametrize("space, optim", [("transformer", "adamw"), ("conv", "sgd"), ("cell", "adamw")])
def test_the_hybrid_placement_computes_the_same_bits(space: str, optim: str, no_static_check) -> None:
    """Hybrid: an op the next subnet reuses keeps its state on the device (a hit next step),
    the others are updated on the host; at the host placement's tightest budget too (the state
    then stays home where there is no room for it), and the bits do not change."""
    ref = reference(space, optim)
    for optimizer in ("device", "host"):  # room for the state of the step's ops, or only their weights
        budget = tight_budget(space, optim, optimizer=optimizer)
        got = run(space, optim, MemorySettings(device_budget_bytes=budget, optimizer="hybrid"), audit=True)
        for key in ("losses", "mb", "eval", "digest"):
            assert got[key] == ref[key], f"{space}/{optim}: {key} differs with the hybrid placement ({optimizer} budget)"
        for a in got["audits"]:
            assert not a.stray, a.stray
        st = got["stats"]
        assert st.host_updates > 0 and st.resident_bytes_peak <= budget
        if optimizer == "device":
            assert st.hits > 0 and st.write_backs > 0  # kept on the device for the next subnet, then sent home


def test_inline_cpu_copies_compute_the_same_bits(no_static_check) -> None:
    budget = tight_budget("cell", "adamw")
    ref = reference("cell", "adamw")
    got = run("cell", "adamw", MemorySettings(device_budget_bytes=budget, cpu_copies="inline", optimizer="device"), audit=True)
    assert got["digest"] == ref["digest"] and got["losses"] == ref["losses"]
    assert got["stats"].late == 0 and all(not a.stray for a in got["audits"])


@pytest.mark.parametrize("policy", ["lru", "on_demand"])
def test_baseline_policies_compute_the_same_bits(policy: str, no_static_check) -> None:
    budget = tight_budget("conv", "sgd")
    ref = reference("conv", "sgd")
    got = run("conv", "sgd", MemorySettings(device_budget_bytes=budget, policy=policy, optimizer="device"))
    assert got["digest"] == ref["digest"] and got["losses"] == ref["losses"]
    if policy == "on_demand":  # nothing fetched ahead: every fetch is a miss
        assert got["stats"].late == 0 and got["stats"].misses == got["stats"].fetches - 0 > 0


def test_prefetch_hides_fetches_with_room_for_two_steps() -> None:
    """With the whole supernet's room, after the first step every use is a hit or a fetch
    made ahead; on demand, every first use is a miss."""
    graph = build_graph("transformer")
    dev = MemorySettings(optimizer="device")  # with the state on the host every use fetches
    room = TensorManager(graph, 0, optim_of("sgd"), memory=dev).footprint(s.op_id for s in graph.slots())
    ahead = run("transformer", "sgd", MemorySettings(device_budget_bytes=room, prefetch_depth=2, optimizer="device"))
    lazy = run("transformer", "sgd", MemorySettings(device_budget_bytes=room, policy="on_demand", optimizer="device"))
    assert sum(st.misses for st in ahead["steps"][1:]) == 0
    assert sum(st.misses for st in lazy["steps"]) == lazy["stats"].fetches > 0
    assert ahead["digest"] == lazy["digest"]


def test_an_infeasible_budget_names_the_field_and_the_shortfall() -> None:
    graph = build_graph("conv")
    with pytest.raises(MemoryBudgetError, match=r"memory\.device_budget_bytes: the largest subnet .* short by \d+ bytes") as e:
        ReferenceEngine(graph, 0, optim_of("sgd"), 4, LrSchedule(0.05, 5), memory=MemorySettings(device_budget_bytes=4096))
    assert e.value.short_by == e.value.needed - 4096 > 0
    tm = TensorManager(graph, 0, optim_of("sgd"), own=[s.op_id for s in graph.slots()],
                       memory=MemorySettings(device_budget_bytes=e.value.needed))
    with pytest.raises(MemoryBudgetError, match="short by"):  # every op at once cannot fit
        tm.ensure(tm.owned())
    tm.close()


@pytest.mark.parametrize("kwargs, field", [
    ({"device_budget_bytes": 0}, "memory.device_budget_bytes"),
    ({"host_memory": "gpu"}, "memory.host_memory"),
    ({"policy": "fifo"}, "memory.policy"),
    ({"prefetch_depth": -1}, "memory.prefetch_depth"),
    ({"max_in_flight": 0}, "memory.max_in_flight"),
    ({"activations": "drop"}, "memory.activations"),
    ({"optimizer": "cpu"}, "memory.optimizer"),
    ({"cpu_copies": "dma"}, "memory.cpu_copies"),
])
def test_bad_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        MemorySettings(**kwargs)


# -- the manager on its own ------------------------------------------------------------------

def small_graph() -> SupernetGraph:
    g = SupernetGraph("t")
    g.add_fixed("stem", OpSpec.of("linear", d_in=8, d_out=8), ["input"])
    g.add_choice("l0", {"a": OpSpec.of("mlp", d=8, hidden=16), "b": OpSpec.of("mlp", d=8, hidden=32)}, ["stem"])
    return g


def train(tm: TensorManager, op_id: str, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tm.ensure([op_id])
        x = torch.randn(4, 8, generator=gen)
        tm.module(op_id)(x, ctx=OpContext(0, 0, 0, op_id, True)).square().sum().backward()
        tm.step([op_id], lr=0.1)
        tm.release_step()


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_ops_migrate_between_resident_and_virtual_managers_from_host_memory(optim: str) -> None:
    """An op in host memory is exported without a fetch; migration either way keeps its
    optimizer state (the continued training equals one that never moved)."""
    g, cfg = small_graph(), optim_of(optim)
    dev = MemorySettings(optimizer="device")  # the state travels with the op: evicting a stepped op writes back
    mem = MemorySettings(device_budget_bytes=TensorManager(g, 0, cfg, memory=dev).footprint(["l0/b"]),
                         optimizer="device")  # one op at a time
    stay = TensorManager(g, 0, cfg, own=["l0/a", "l0/b"])
    virt = TensorManager(g, 0, cfg, own=["l0/a", "l0/b"], memory=mem)
    for tm in (stay, virt):
        train(tm, "l0/a", 2, seed=1)
        train(tm, "l0/b", 1, seed=3)  # evicts l0/a (dirty: written back)
    assert virt.stats().written_back_bytes > 0
    fetched = virt.stats().fetched_bytes
    state = virt.export("l0/a")  # in host memory: no fetch
    assert virt.stats().fetched_bytes == fetched and not virt.owns("l0/a")
    assert all(t.device.type == "cpu" for t in state.values())
    plain = TensorManager(g, 0, cfg)  # virtual -> resident -> virtual
    plain.adopt("l0/a", state)
    back = TensorManager(g, 0, cfg, memory=mem)
    back.adopt("l0/a", plain.export("l0/a"))
    train(stay, "l0/a", 2, seed=2)
    train(back, "l0/a", 2, seed=2)
    assert params_digest({"x": stay.export("l0/a", release=False)}) == \
        params_digest({"x": back.export("l0/a", release=False)})
    for tm in (virt, back):
        tm.close()


def test_only_dirty_ops_are_written_back() -> None:
    g = small_graph()
    dev = MemorySettings(optimizer="device")
    tm = TensorManager(g, 0, optim_of("sgd"), own=["l0/a", "l0/b"],
                       memory=MemorySettings(device_budget_bytes=TensorManager(g, 0, optim_of("sgd"), memory=dev)
                                             .footprint(["l0/b"]), optimizer="device"))
    with torch.no_grad():  # used without a step (and no buffers): clean
        tm.ensure(["l0/a"])
        tm.module("l0/a")(torch.ones(2, 8), ctx=OpContext(0, 0, 0, "l0/a", False))
        tm.release_step()
    tm.ensure(["l0/b"])  # evicts l0/a: nothing to write back
    assert tm.stats().evictions == 1 and tm.stats().written_back_bytes == 0
    tm.release_step()
    train(tm, "l0/b", 1, seed=0)
    tm.ensure(["l0/a"])  # evicts l0/b, which took a step
    assert tm.stats().written_back_bytes == tm.footprint(["l0/b"])
    tm.close()


def test_a_budget_of_none_is_todays_manager() -> None:
    tm = TensorManager(small_graph(), 0, optim_of("adamw"), own=["stem"])
    assert not tm.virtual and tm.audit() is None
    train(tm, "stem", 1, seed=0)
    st = tm.stats()
    assert st.budget_bytes is None and st.resident_bytes == 8 * 8 * 4 * 3 + 8 * 4 * 3 and st.fetched_bytes == 0


# -- the arena -------------------------------------------------------------------------------

def test_arena_best_fit_compaction_and_overlapping_moves() -> None:
    a = Arena(640, torch.device("cpu"), 64)
    for i, n in enumerate([128, 64, 192, 64, 128]):
        assert a.allocate(f"o{i}", n) is not None
    assert a.allocate("x", 64) == 576 and a.allocate("y", 64) is None
    a.free("x")
    a.buffer[:] = torch.arange(640) % 251
    expect = {op: a.buffer[off : off + n].clone() for op, (off, n) in a.regions.items()}
    a.free("o1")
    a.free("o3")
    assert a.gaps() == [(128, 64), (384, 64), (576, 64)] and a.allocate("z", 128) is None
    moves = a.plan_compaction(fixed=["o4"])  # o4 stays at 448; o2 slides down over its own bytes
    assert moves == {"o2": 128}
    for op, off in moves.items():
        a.move(op, off)
    for op, (off, n) in a.regions.items():
        assert torch.equal(a.buffer[off : off + n], expect[op]), op
    assert a.allocate("z", 128) == 320 and a.used == 128 + 192 + 128 + 128


def test_slots_alias_the_buffer_without_sharing_its_version_counter() -> None:
    layout = OpLayout.build([("param", "w", 0, torch.float32, (3, 5)), ("buffer", "n", -1, torch.int64, ())], 64)
    assert [s.offset for s in layout.slots] == [0, 64] and layout.nbytes == 128
    buf = torch.zeros(256, dtype=torch.uint8)
    w, n = (s.view(buf, 128) for s in layout.slots)
    w.fill_(1.5)
    before = w._version
    n.add_(7)
    assert buf[128:188].view(torch.float32).eq(1.5).all() and buf[192:200].view(torch.int64).item() == 7
    assert w._version == before and buf._version == 0  # in-place on one slot does not touch the others


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optim,placement", [("adamw", "device"), ("sgd", "hybrid"), ("adamw", "hybrid")])
def test_cuda_budget_is_bit_identical_to_resident(optim: str, placement: str, no_static_check) -> None:
    """On the GPU (deterministic kernels, tests/conftest.py) a budget computes all-resident's bits
    wherever each update runs: SGD's kernels round alike on the host and the GPU, and on CUDA the
    manager's AdamW is PortableAdamW, whose do too (torch's fused AdamW kernels do not:
    bench/cuda_bits.py)."""
    graph = build_graph("conv")
    outs = []
    budget = tight_budget("conv", optim, optimizer=placement, device="cuda")
    for mem in (None, MemorySettings(device_budget_bytes=budget, optimizer=placement)):
        e = ReferenceEngine(graph, 0, optim_of(optim), 4, LrSchedule(optim_of(optim).lr, STEPS), "cuda", memory=mem)
        archs = arch_stream(graph, 0, STEPS + 1)
        losses = []
        for s in range(STEPS):
            e.plan_ahead(archs[s + 1 : s + 3])
            losses.append(e.train_step(s, archs[s], *step_data(0, s, 16)).loss)
        outs.append((losses, params_digest(e.op_states())))
        e.close()
    assert outs[0] == outs[1]


def test_a_budget_as_a_fraction_of_free_cuda_memory() -> None:
    mem = MemorySettings(device_budget_fraction=0.25)
    assert mem.virtual
    assert mem.budget_for(torch.device("cuda:0"), free_bytes=lambda d: 8_000_000) == 2_000_000
    with pytest.raises(ValueError, match=r"memory\.device_budget_fraction: .* needs a CUDA device"):
        mem.budget_for(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"memory\.device_budget_fraction: expected a number in \(0, 1\]"):
        MemorySettings(device_budget_fraction=1.5)
    with pytest.raises(ValueError, match=r"memory\.device_budget_fraction: expected null when"):
        MemorySettings(device_budget_bytes=10, device_budget_fraction=0.5)


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        MemorySettings().policy = "lru"  # type: ignore[misc]


# -- the CUDA copy path, with CPU stand-ins for streams and events ---------------------------

class _FakeEvent:
    def __init__(self, log: list) -> None:
        self.log, self.recorded_on, self.waited = log, None, 0

    def record(self, stream) -> None:
        self.recorded_on = stream
        self.log.append(("record", stream.name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.recorded_on.name))


class _FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event) -> None:
        event.waited += 1
        self.log.append(("wait_event", self.name))

    def synchronize(self) -> None:
        self.log.append(("stream_synchronize", self.name))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list:
    """torch.cuda's streams and events replaced by stand-ins that log what the copier asks for
    (copies themselves run at once, on CPU tensors)."""
    import contextlib

    log: list = []
    compute = _FakeStream("compute", log)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream("side", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _FakeEvent(log))

    @contextlib.contextmanager
    def stream(s):
        log.append(("enter", s.name))
        yield
        log.append(("exit", s.name))

    monkeypatch.setattr(torch.cuda, "stream", stream)
    return log


def test_cuda_copier_orders_copies_after_compute_and_compute_after_copies(fake_cuda: list) -> None:
    from pipeline.memory.copies import CudaCopier

    copier = CudaCopier(torch.device("cuda"))
    src, dst = torch.arange(8.0), torch.zeros(8)
    h = copier.copy(dst, src)
    assert torch.equal(dst, src)
    # the side stream waits for the compute queued so far (a region is overwritten only after
    # the kernels that read it), copies, and records an event on itself
    assert fake_cuda == [("wait_stream", "side", "compute"), ("enter", "side"), ("record", "side"), ("exit", "side")]
    h.wait()  # before use: the compute stream waits for the event (the host does not block)
    assert fake_cuda[-1] == ("wait_event", "compute") and h.done()
    h.synchronize()  # before the host reads or frees a host buffer
    assert fake_cuda[-1] == ("synchronize", "side")


def test_the_store_waits_for_every_fetch_through_cuda_handles(fake_cuda: list, no_static_check) -> None:
    """The whole manager driven through the CUDA copier (stand-ins): every fetch's event is
    waited on by the compute stream before the op is used, and the bits are unchanged."""
    from pipeline.memory.copies import CudaCopier

    events: list[_FakeEvent] = []
    real_event = torch.cuda.Event

    def event(*a, **k):
        events.append(real_event())
        return events[-1]

    torch.cuda.Event = event  # restored by the fixture's monkeypatch
    graph = build_graph("conv")
    archs = arch_stream(graph, 0, STEPS + 1)
    digests = []
    for mem in (None, MemorySettings(device_budget_bytes=tight_budget("conv", "adamw"))):
        engine = ReferenceEngine(graph, 0, optim_of("adamw"), 4, LrSchedule(3e-3, STEPS), "cpu", memory=mem)
        if mem is not None:
            store = engine.tensors._store
            store.copier = CudaCopier(torch.device("cuda"))
            real_start, fetch_events = store._start_fetch, []

            def start_fetch(rec, off, real_start=real_start, fetch_events=fetch_events):
                real_start(rec, off)
                fetch_events.append(rec.fetch._event)

            store._start_fetch = start_fetch
        for s in range(STEPS):
            engine.plan_ahead(archs[s + 1 : s + 3])
            engine.train_step(s, archs[s], *step_data(0, s, 16))
        digests.append(params_digest(engine.op_states()))
    st = engine.tensors.stats()
    assert st.fetches > 0 and st.write_backs > 0
    assert len(events) == st.fetches + st.write_backs
    assert len(fetch_events) == st.fetches
    assert all(e.waited >= 1 for e in fetch_events)  # the compute stream waits before using a fetch
    assert digests[0] == digests[1]


# -- eviction and prefetch decisions ---------------------------------------------------------

def four_equal_ops() -> SupernetGraph:
    g = SupernetGraph("four")
    g.add_choice("l0", {k: OpSpec.of("mlp", d=8, hidden=16) for k in "abcd"}, ["input"])
    return g


def manager(policy: str, ops: int, **kw) -> TensorManager:
    g = four_equal_ops()
    one = TensorManager(g, 0, optim_of("sgd")).footprint(["l0/a"])
    return TensorManager(g, 0, optim_of("sgd"), own=[f"l0/{k}" for k in "abcd"],
                         memory=MemorySettings(device_budget_bytes=ops * one, policy=policy, **kw))


def resident(tm: TensorManager) -> set[str]:
    tm._store._drain()
    return {o for o, r in tm._store.ops.items() if r.state == "resident"}


def test_belady_evicts_the_op_needed_last_and_never_one_needed_sooner() -> None:
    """Room for two equal ops; a and b resident (a used first); next come c, a, b."""
    evicted: dict[str, list[str]] = {}
    for policy in ("belady", "lru"):
        tm = manager(policy, ops=2)
        log = evicted[policy] = []
        real = tm._store._evict
        tm._store._evict = lambda rec, real=real, log=log: (log.append(rec.op_id), real(rec))[1]
        tm.ensure(["l0/a", "l0/b"])
        tm.release_step()
        tm.prefetch([{"l0/c"}, {"l0/a"}, {"l0/b"}])
        tm.ensure(["l0/c"])
        tm.release_step()
        tm.ensure(["l0/a"])
        tm.release_step()
        assert tm.stats().misses == 2  # the first step's a and b: every later use was fetched ahead
        tm.close()
    # Belady: b (needed last) makes room for c; b comes back once c is done, in c's place. a,
    # needed sooner than b, is never evicted.
    assert evicted["belady"] == ["l0/b", "l0/c"]
    # LRU evicts a (used first) for c, then b (used less recently than c) to fetch a back, then
    # c for b: one eviction, and one fetch, more.
    assert evicted["lru"] == ["l0/a", "l0/b", "l0/c"]


class _NeverDone:
    """A copy engine whose copies stay in flight until waited on."""

    def __init__(self) -> None:
        self.issued = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        self.issued += 1
        dst.copy_(src)

        class H:
            def wait(self) -> None: ...
            synchronize = wait

            def done(self) -> bool:
                return False

        return H()

    def flush(self) -> None: ...

    def close(self) -> None: ...


def test_prefetch_keeps_at_most_max_in_flight_copies_outstanding() -> None:
    tm = manager("belady", ops=4, max_in_flight=2, prefetch_depth=3)
    tm._store.copier = copier = _NeverDone()
    tm.prefetch([{"l0/a"}, {"l0/b"}, {"l0/c"}, {"l0/d"}])
    assert copier.issued == 2 and len(tm._store.in_flight) == 2
    tm.ensure(["l0/a"])  # a's copy completes (waited on); b's is still outstanding
    assert copier.issued == 2
    tm.ensure(["l0/c"])  # not fetched ahead: a demand fetch is never held back by the cap
    assert copier.issued == 3 and tm.stats().misses == 1
    tm.close()


def test_resuming_from_op_states_with_a_budget_continues_the_same_bits(no_static_check) -> None:
    """A checkpoint's op states (exported from host memory) load into a budgeted engine, which
    continues exactly as an all-resident run that never stopped."""
    graph, optim = build_graph("conv"), optim_of("adamw")
    archs = arch_stream(graph, 0, STEPS + 1)
    mem = MemorySettings(device_budget_bytes=tight_budget("conv", "adamw"))

    def train(engine: ReferenceEngine, steps: range) -> list[float]:
        out = []
        for s in steps:
            engine.plan_ahead(archs[s + 1 : s + 3])
            out.append(engine.train_step(s, archs[s], *step_data(0, s, 16)).loss)
        return out

    lr = LrSchedule(optim.lr, STEPS, "cosine", 1)
    plain = ReferenceEngine(graph, 0, optim, 4, lr)
    ref = train(plain, range(STEPS))
    first = ReferenceEngine(graph, 0, optim, 4, lr, memory=mem)
    got = train(first, range(3))
    states = first.op_states()
    first.close()
    second = ReferenceEngine(graph, 0, optim, 4, lr, memory=mem)
    second.load_op_states(states)
    got += train(second, range(3, STEPS))
    assert got == ref
    assert params_digest(second.op_states()) == params_digest(plain.op_states())
    second.close()


@pytest.mark.parametrize("policy", ["belady", "lru", "on_demand"])
def test_the_runtime_store_and_the_offline_plan_fetch_alike(policy: str) -> None:
    """One policy object serves both: on unit-size traces without prefetch ahead, the store's
    fetches equal the residency plan's (for Belady: the exhaustive optimum, tests/test_residency.py)."""
    from pipeline.plan.residency import plan_residency

    for seed in range(30):
        rng = random.Random(seed)
        n_ops, cache = rng.randint(3, 8), rng.randint(2, 4)
        g = SupernetGraph("unit")
        for k in range(n_ops):
            g.add_fixed(f"o{k}", OpSpec.of("mlp", d=8, hidden=16), ["input"])
        ids = [s.op_id for s in g.slots()]
        trace = [tuple(rng.sample(ids, rng.randint(1, 2))) for _ in range(rng.randint(4, 12))]
        one = TensorManager(g, 0, optim_of("sgd"), memory=MemorySettings(optimizer="device")).footprint(ids[:1])
        tm = TensorManager(g, 0, optim_of("sgd"), own=ids, memory=MemorySettings(
            device_budget_bytes=cache * one, policy=policy, prefetch_depth=0, optimizer="device"))
        for t in range(len(trace)):
            tm.prefetch([set(s) for s in trace[t:]])
            tm.ensure(trace[t])
            tm.release_step()
        plan = plan_residency(trace, {o: 1 for o in ids}, cache, policy, prefetch_depth=0)
        assert tm.stats().fetches == plan.fetches, (seed, trace)
        tm.close()


# -- two copy streams, arrivals into the arena, the horizon past the subnets in flight ---------

def test_a_copy_waits_for_the_other_streams_copies_that_touch_its_bytes() -> None:
    from pipeline.memory.copies import conflicts

    region, home, other_home = ("cuda:0", 0, 100), ("host", 1000, 1100), ("host", 2000, 2100)
    earlier = [("d2h", home, region),  # a write-back of the region into its home
               ("d2h", other_home, ("cuda:0", 200, 300)),  # another op's write-back
               ("h2d", ("cuda:0", 0, 100), other_home)]  # on the same stream as the copy below
    # a fetch into the region being written back waits for that write-back, not for the other one
    assert conflicts(("cuda:0", 50, 150), ("host", 5000, 5100), "h2d", earlier) == [0]
    # reading a home while it is being written waits too; on the same stream nothing is needed
    assert conflicts(("cuda:0", 400, 500), home, "h2d", earlier) == [0]
    assert conflicts(("cuda:0", 0, 100), other_home, "h2d", earlier[2:]) == []
    # a write-back waits for a fetch still filling the region it reads, or reading the home it writes
    assert conflicts(("host", 9000, 9100), ("cuda:0", 0, 10), "d2h", earlier) == [2]
    assert conflicts(other_home, ("cuda:0", 900, 950), "d2h", earlier) == [2]
    # touching ends do not overlap; different memories never do
    assert conflicts(("cuda:0", 100, 200), ("host", 0, 10), "h2d", earlier) == []
    assert conflicts(("cuda:1", 0, 100), ("host", 0, 10), "h2d", earlier) == []


def test_the_cuda_copier_runs_fetches_beside_write_backs(fake_cuda: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fetches and write-backs go on streams of their own; a fetch into a region whose write-back
    is still in flight waits for its event, one into other bytes does not."""
    import itertools

    from pipeline.memory import copies

    names = itertools.count()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(f"side{next(names)}", fake_cuda))
    pending = _FakeEvent(fake_cuda)
    pending.query = lambda: False  # the write-back below is still in flight
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: pending)
    arena, home_a, home_b = torch.zeros(16), torch.arange(8.0), torch.arange(8.0) + 10
    ways = {id(home_a): "d2h"}
    monkeypatch.setattr(copies, "_direction", lambda dst, src: ways.get(id(dst), "h2d"))
    copier = copies.CudaCopier(torch.device("cuda"))
    h2d, d2h = copier.streams["h2d"].name, copier.streams["d2h"].name
    assert h2d != d2h
    copier.copy(home_a, arena[:8])  # write-back of a's region
    fake_cuda.clear()
    copier.copy(arena[8:], home_b)  # a fetch into other bytes: no wait on the write-back
    assert ("wait_event", h2d) not in fake_cuda and ("enter", h2d) in fake_cuda
    fake_cuda.clear()
    copier.copy(arena[:8], home_b)  # a fetch into a's region: waits for its write-back first
    assert fake_cuda.index(("wait_event", h2d)) < fake_cuda.index(("enter", h2d))


def test_an_arriving_op_lands_in_the_arena_and_leaves_from_it() -> None:
    """An op adopted while a coming step uses it goes straight into the arena (no fetch at its
    use, no write-back when it leaves again) and trains to the same bits as one that never moved."""
    g, cfg = small_graph(), optim_of("adamw")
    for optimizer in ("device", "hybrid"):
        mem = MemorySettings(device_budget_bytes=2 * TensorManager(g, 0, cfg, memory=MemorySettings(
            optimizer="device")).footprint(["l0/b"]), optimizer=optimizer)
        stay = TensorManager(g, 0, cfg, own=["l0/a"])
        src = TensorManager(g, 0, cfg, own=["l0/a"], memory=mem)
        for tm in (stay, src):
            train(tm, "l0/a", 2, seed=1)
        dst = TensorManager(g, 0, cfg, own=[], memory=mem)
        dst.prefetch([["l0/a"]])
        before = src.stats().written_back_bytes
        dst.adopt("l0/a", src.export("l0/a"))  # resident at src: leaves from the arena
        assert src.stats().written_back_bytes == before
        dst.ensure(["l0/a"])  # its first use here: resident already
        st = dst.stats()
        assert st.arrived == 1 and st.fetches == 0 and st.misses == 0 and st.hits == 1, optimizer
        dst.release_step(advance=False)
        train(stay, "l0/a", 2, seed=2)
        train(dst, "l0/a", 2, seed=2)
        assert params_digest({"x": stay.export("l0/a", release=False)}) == \
            params_digest({"x": dst.export("l0/a", release=False)}), optimizer
        state = dst.export("l0/a")
        dst.prefetch([])
        dst.adopt("l0/a", state)  # not in the future: into its host home
        assert dst.stats().arrived == 1 and dst._store.ops["l0/a"].state == "host"
        for tm in (src, dst):
            tm.close()


def test_fetches_ahead_look_past_the_subnets_in_flight() -> None:
    """With prefetch_depth 0 and one subnet still in flight, the end of another fetches the
    next subnet after the one in flight (the horizon does not count those running)."""
    tm = manager("belady", 4, prefetch_depth=0)
    tm.prefetch([["l0/a"], ["l0/b"], ["l0/c"], ["l0/d"]])
    tm.ensure(["l0/a"])
    tm.ensure(["l0/b"])  # both in flight
    tm.release_step(ops=["l0/a"], done=0, in_flight=1)
    assert "l0/c" in resident(tm)
    tm.close()


def test_portable_adamw_is_adamw_to_rounding_with_the_same_state() -> None:
    """The AdamW the tensor manager runs on CUDA (bench/cuda_bits.py checks its bits there):
    torch's AdamW's update to float rounding, with torch's state keys."""
    g = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(257, generator=g), [torch.randn(257, generator=g) for _ in range(20)]
    outs = []
    for portable in (False, True):
        p = torch.nn.Parameter(p0.clone())
        cfg = dataclasses.replace(optim_of("adamw"), weight_decay=0.01, portable=portable)
        opt = cfg.build([p])
        for gr in grads:
            p.grad = gr.clone()
            opt.step()
        outs.append((p.detach().clone(), opt.state[p]))
    (a, sa), (b, sb) = outs
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-7) and not torch.equal(p0, b)
    assert set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"} and float(sb["step"]) == 20
    assert torch.allclose(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-6)


def test_the_host_square_root_is_the_correctly_rounded_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """PortableAdamW's square root on the host (numpy's float32 sqrt) gives the float64 path's
    bits, the device's: on every float32 in [1, 4) (where torch's CPU float sqrt is one ulp off
    for many) and on tiny, huge and special values; and a step with either gives the same
    parameters and state. A sqrt that rounds otherwise fails the per-process check, and the host
    then takes the float64 path."""
    import numpy as np

    from pipeline.memory import optim

    x = torch.cat([torch.arange(0x3F800000, 0x40800000, dtype=torch.int64).to(torch.int32).view(torch.float32),
                   torch.rand(1 << 16) * 1e-35, torch.rand(1 << 16) * 1e35,
                   torch.tensor([0.0, -0.0, float("inf"), 1e-45, 1.1754942e-38, 3.4028235e38])])
    exact = x.double().sqrt().float().view(torch.int32)
    assert torch.equal(optim.correct_sqrt(x).view(torch.int32), exact)
    assert not torch.equal(x.sqrt().view(torch.int32), exact)  # (why: torch's own CPU kernel)
    cfg = dataclasses.replace(optim_of("adamw"), weight_decay=0.01, portable=True)
    got = []
    for numpy_sqrt in (True, False):
        monkeypatch.setattr(optim, "_numpy_sqrt_ok", lambda u=numpy_sqrt: u)
        step = optim.synthetic_update(cfg, 3, 1 << 14)
        for _ in range(3):
            step()
        got.append([p.detach().clone() for p in step.params])
    assert all(torch.equal(a, b) for a, b in zip(*got))
    monkeypatch.undo()
    optim._numpy_sqrt_ok.cache_clear()
    monkeypatch.setattr(np, "sqrt", lambda a, out=None: torch.from_numpy(a).sqrt().numpy())
    try:
        assert not optim._numpy_sqrt_ok()
    finally:
        optim._numpy_sqrt_ok.cache_clear()


def test_portable_adamw_is_its_formula_bit_for_bit() -> None:
    """PortableAdamW against its formula written plainly (fresh temporaries, the square root in
    float64 rounded once): the same bits after four steps, contiguous and strided gradients of
    several shapes, one optimizer stepping them in turn (its scratch tensors reused)."""
    import math

    from pipeline.memory.optim import PortableAdamW

    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    g0 = torch.Generator().manual_seed(5)
    start = [torch.randn(s, generator=g0) for s in ((64, 33), (1000,), (3, 5, 7), (256, 128))]
    got = [nn.Parameter(x.clone()) for x in start]
    want = [(x.clone(), torch.zeros_like(x), torch.zeros_like(x)) for x in start]
    opt = PortableAdamW(got, lr, (b1, b2), eps, wd)
    for t in range(1, 5):
        for p, (q, m, v) in zip(got, want):
            g = torch.randn(p.shape, generator=g0) * 10.0 ** (t - 2)
            if g.dim() == 2:
                g = g.t().contiguous().t()  # strided
            p.grad = g
            q.mul_(1 - lr * wd)
            m.mul_(b1).add_(g * (1 - b1))
            v.mul_(b2).add_((g * g).mul_(1 - b2))
            denom = v.double().sqrt().float().mul_(1 / math.sqrt(1 - b2 ** t)).add_(eps)
            q.sub_(m.div(denom).mul_(lr / (1 - b1 ** t)))
        opt.step()
    for p, (q, m, v) in zip(got, want):
        st = opt.state[p]
        assert torch.equal(p.detach(), q) and torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], v)


def test_the_manager_runs_portable_adamw_on_cuda_only() -> None:
    graph = build_graph("conv")
    assert not TensorManager(graph, 0, optim_of("adamw")).optim.portable
    assert not TensorManager(graph, 0, optim_of("sgd"), "meta").optim.portable


@pytest.mark.parametrize("seconds, on_host", [(None, True), (1.0, True), (0.0, False)])
def test_a_host_that_cannot_step_an_op_in_time_leaves_its_state_on_the_device(seconds, on_host: bool) -> None:
    """memory.host_update_rate: the hybrid placement sends an op not reused by the next step
    home to be stepped by the host only while the host can step it within the step's compute
    (``host_seconds``); past that, its state comes along and the device steps it."""
    graph = build_graph("conv")
    own = [s.op_id for s in graph.slots()]
    room = TensorManager(graph, 0, optim_of("sgd"), own=own, memory=MemorySettings(optimizer="device")).footprint(own)
    mem = MemorySettings(device_budget_bytes=room, optimizer="hybrid", host_update_rate=1e9)
    tm = TensorManager(graph, 0, optim_of("sgd"), own=own, memory=mem)
    a, b = (frozenset(o.op_id for o in graph.active_ops(x)) & set(own) for x in arch_stream(graph, 3, 2))
    alone = [o for o in a - b if tm._store.ops[o].params]  # not reused by the next step: the host's by the rule
    assert alone
    tm.prefetch([a, b], None if seconds is None else [seconds, None])
    assert {tm._store.ops[o].optim_on_host for o in alone} == {on_host}
    if seconds is None:  # no rate asked for: as without memory.host_update_rate
        tm2 = TensorManager(graph, 0, optim_of("sgd"), own=own, memory=dataclasses.replace(mem, host_update_rate=None))
        tm2.prefetch([a, b], [0.0, None])
        assert all(tm2._store.ops[o].optim_on_host for o in alone)


def test_an_auto_host_update_rate_is_measured_once_and_bounds_what_goes_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """memory.host_update_rate: auto (the default) measures the host's rate once, on the
    host-update threads with the run's optimizer, when a plan first gives the step's seconds; it
    then bounds what hybrid sends home as a number would. Nothing is measured where it cannot
    matter (no estimate, no budget, not hybrid)."""
    from pipeline.memory.host_updates import HostUpdates

    graph = build_graph("conv")
    own = [s.op_id for s in graph.slots()]
    room = TensorManager(graph, 0, optim_of("sgd"), own=own, memory=MemorySettings(optimizer="device")).footprint(own)
    mem = MemorySettings(device_budget_bytes=room, optimizer="hybrid", host_update_threads=2)
    assert MemorySettings().host_update_rate == "auto"
    tm = TensorManager(graph, 0, optim_of("adamw"), own=own, memory=mem)
    rate = tm.host_update_rate()  # the real measurement: two threads, AdamW
    assert 0 < rate < float("inf") and tm.host_update_rate() is rate  # once
    for other in (dataclasses.replace(mem, optimizer="host"), MemorySettings(optimizer="hybrid")):
        assert TensorManager(graph, 0, optim_of("sgd"), own=own, memory=other).host_update_rate() is None
    assert TensorManager(graph, 0, optim_of("sgd"), own=own,
                         memory=dataclasses.replace(mem, host_update_rate=5.0)).host_update_rate() == 5.0

    calls = []

    def slow_host(self, make_job, rounds=3):
        calls.append(make_job(0)())  # the job steps its parameters and counts them
        return 1.0  # one parameter a second: nothing goes home

    monkeypatch.setattr(HostUpdates, "throughput", slow_host)
    for seconds, on_host in ((None, True), (1.0, False)):
        tm = TensorManager(graph, 0, optim_of("sgd"), own=own, memory=mem)
        a, b = (frozenset(o.op_id for o in graph.active_ops(x)) & set(own) for x in arch_stream(graph, 3, 2))
        alone = [o for o in a - b if tm._store.ops[o].params]
        tm.prefetch([a, b], None if seconds is None else [seconds, None])
        assert {tm._store.ops[o].optim_on_host for o in alone} == {on_host}
    assert calls == [1 << 21]  # measured only where a plan gave seconds


def test_the_host_rate_is_what_the_pool_steps_a_second() -> None:
    import time

    from pipeline.memory.host_updates import HostUpdates

    for threads in (0, 3):
        made = []

        def make_job(k):
            made.append(k)

            def job():
                time.sleep(0.02)
                return 1000

            return job

        hu = HostUpdates(threads)
        rate = hu.throughput(make_job, rounds=2)
        hu.close()
        assert made == list(range(max(1, threads)))
        assert 0 < rate <= max(1, threads) * 1000 / 0.02  # (a sleep never ends early; no lower bound: the machine may be busy)


def test_the_host_update_rate_names_the_field() -> None:
    for bad in (0, -1.0, float("inf"), "fast", True):
        with pytest.raises(ValueError, match=r"memory\.host_update_rate: expected a positive number \(parameters/s\), "
                                             r"'auto' or null, found"):
            MemorySettings(host_update_rate=bad)
    for good in ("auto", None, 1e9, 3):
        MemorySettings(host_update_rate=good)


@pytest.mark.parametrize("threads, shared_ops", [(0, "exact"), (2, "exact"), (2, "delayed")])
def test_updates_at_home_run_beside_training_and_are_waited_for(threads: int, shared_ops: str, no_static_check,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """memory.host_update_threads: the host's updates run on their own threads (none: on the
    training thread) while training goes on; each is slowed here so that the op's next fetch,
    the evaluation and the export find it still running and must wait for it: the same bits
    (delayed shared ops too: their new version is kept right after the update)."""
    import threading
    import time

    seen = []
    real = TensorManager._step_at_home

    def slow(self, op_id, grads, lr):
        seen.append(threading.current_thread().name)
        time.sleep(0.01)
        real(self, op_id, grads, lr)

    monkeypatch.setattr(TensorManager, "_step_at_home", slow)
    ref = reference("transformer", "adamw") if shared_ops == "exact" else run("transformer", "adamw", None,
                                                                             shared_ops=shared_ops)
    mem = MemorySettings(device_budget_bytes=tight_budget("transformer", "adamw"), optimizer="host",
                         host_update_threads=threads)
    got = run("transformer", "adamw", mem, audit=True, shared_ops=shared_ops)
    for key in ("losses", "mb", "eval", "digest"):
        assert got[key] == ref[key], f"{key} differs with {threads} host-update threads"
    assert seen and all(n.startswith("pipenas-host-update") == (threads > 0) for n in seen), set(seen)


@pytest.mark.parametrize("threads", [0, 2])
def test_gradients_copied_home_off_the_training_thread_are_waited_for_by_the_update(
        threads: int, no_static_check, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device gradient of an op updated at home travels on the copier's write-back stream and
    the training thread goes on; the update waits for the copy. A CPU stand-in: gradients count
    as device memory here, and the copies run late on the copy thread (``memory.cpu_copies=
    thread``, each batch slowed), so an update that did not wait would read unwritten memory."""
    import time

    from pipeline.memory import copies, virtual

    real = copies._run_copies

    def late(batch):
        time.sleep(0.005)
        real(batch)

    monkeypatch.setattr(copies, "_run_copies", late)
    monkeypatch.setattr(virtual, "_in_host_memory", lambda t: False)
    waited = []
    done = virtual._GradCopies.done

    def counted(self):
        waited.append(len(self.handles))
        done(self)

    monkeypatch.setattr(virtual._GradCopies, "done", counted)
    ref = reference("transformer", "adamw")
    mem = MemorySettings(device_budget_bytes=tight_budget("transformer", "adamw"), optimizer="host",
                         host_update_threads=threads, cpu_copies="thread", host_memory="pageable")
    got = run("transformer", "adamw", mem, audit=True)
    for key in ("losses", "mb", "eval", "digest"):
        assert got[key] == ref[key], f"{key} differs with {threads} host-update threads"
    assert waited and all(n > 0 for n in waited)


def test_host_update_threads_default_to_this_process_share_of_the_cores() -> None:
    from pipeline.memory.host_updates import auto_threads

    assert [auto_threads(c, 1) for c in (1, 2, 4, 16, 64)] == [1, 1, 3, 8, 8]
    assert [auto_threads(16, n) for n in (2, 4, 8)] == [7, 3, 1]
    for bad in (-1, 1.5, "two", True):
        with pytest.raises(ValueError, match=r"memory\.host_update_threads: expected an integer >= 0 or null"):
            MemorySettings(host_update_threads=bad)


def test_a_failed_host_update_is_raised_with_its_op_when_the_op_is_next_needed() -> None:
    from pipeline.memory.host_updates import HostUpdates

    for threads in (0, 1):
        hu = HostUpdates(threads)

        def boom() -> None:
            raise ValueError("no room")

        if threads == 0:  # on the training thread: at once
            with pytest.raises(ValueError, match="no room"):
                hu.submit("l0/a", boom)
            continue
        hu.submit("l0/a", boom)
        with pytest.raises(RuntimeError, match=r"host's optimizer update of op 'l0/a' failed: ValueError: no room"):
            hu.wait("l0/a")
        assert not hu.pending("l0/a") and not hu.wait("l0/a")  # reported once
        hu.close()
