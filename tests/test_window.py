"""Windows (disteval.metrics.window) in one process: an evaluator that records windows while it evaluates,
and a second evaluator that adds some of them in place of evaluating their batches, give metrics ``==`` an
evaluator that evaluated every batch (bitwise and fast mode, sum-, gather- and float-states, any pattern of
recorded and evaluated batches); a window whose bytes changed is refused by its digest."""
import pytest
import torch

from disteval.metrics import ClassificationMetrics, MetricCollection, RankingMetrics
from disteval.metrics.evaluator import Evaluator
from disteval.metrics.window import Window
from dist_workers import NUM_CLASSES, synthetic_logits

N, B = 203, 8


def _metric():
    return MetricCollection({"classification": ClassificationMetrics(NUM_CLASSES, topk=(1, 3)),
                             "ranking": RankingMetrics(NUM_CLASSES)})


def _batches():
    logits, labels = synthetic_logits(N, seed=3)
    x, y = torch.from_numpy(logits), torch.from_numpy(labels)
    return [(s // B, x[s:s + B], y[s:s + B], torch.arange(s, min(s + B, N))) for s in range(0, N, B)]


def _run(bitwise: bool, every: int | None = None, recorded: list[Window] = (), skip: set[int] = frozenset()):
    ev = Evaluator(_metric(), bitwise=bitwise, record_batches=True)
    ev.windows = every is not None
    ev.schedule(list(recorded))
    windows = []
    for k, (index, x, y, ids) in enumerate(_batches()):
        if index in skip:
            continue
        ev.process(index, x, y, ids)
        if every and (k + 1) % every == 0:
            windows.append(ev.take_window())
    if every:
        windows.append(ev.take_window())
    ev.finish_local()
    return ev, [w for w in windows if w is not None]


@pytest.mark.parametrize("bitwise", [True, False])
@pytest.mark.parametrize("every", [1, 3, 7])
def test_recorded_windows_added_in_order_equal_an_uninterrupted_evaluation(bitwise, every):
    whole, _ = _run(bitwise)
    want = whole.metric.compute()
    _, windows = _run(bitwise, every=every)
    assert sum(w.samples for w in windows) == N
    for keep in (windows[::2], windows[1::2], windows[:1], windows[-1:], windows):
        # the batches of the kept windows are not evaluated again: they are added from the records
        skip = {int(b) for w in keep for b in w.spans[:, 0]}
        ev, _ = _run(bitwise, recorded=[Window.from_tensors(w.to_tensors()) for w in keep], skip=skip)
        got = ev.metric.compute()
        if bitwise:
            assert got == want  # bit for bit, float sums included
            assert ev.batch_log() == whole.batch_log()
        else:  # fast mode: counts exact, float sums within rounding
            for key, value in want.items():
                if isinstance(value, float):
                    assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
                else:
                    assert got[key] == value, key
        assert ev.replayed == {"windows": len(keep), "samples": sum(w.samples for w in keep)}
        assert (ev.coverage.runs() == whole.coverage.runs()).all()


def test_a_window_evaluated_around_recorded_ones_is_closed_before_them():
    """Evaluating batches 0-2, then adding recorded batches 3-5: the open window closes before the
    recorded ones are added (a window never mixes evaluated and recorded batches)."""
    _, windows = _run(True, every=3)
    ev = Evaluator(_metric(), bitwise=True)
    ev.windows = True
    ev.schedule([windows[1]])
    for index, x, y, ids in _batches()[:3] + _batches()[6:8]:
        ev.process(index, x, y, ids)
    last = ev.take_window()
    assert [int(b) for b in ev.closed[0].spans[:, 0]] == [0, 1, 2]
    assert [int(b) for b in last.spans[:, 0]] == [6, 7]


def test_a_changed_window_is_refused_by_its_digest():
    _, windows = _run(True, every=4)
    data = windows[0].to_tensors()
    data["states"] = {k: v.clone() for k, v in data["states"].items()}
    name = next(k for k, v in data["states"].items() if v.dtype == torch.int64 and v.numel())
    data["states"][name].view(-1)[0] += 1
    with pytest.raises(ValueError, match="digest"):
        Window.from_tensors(data)
    with pytest.raises(ValueError, match="overlap"):
        Evaluator(_metric()).schedule([windows[0], windows[0]])


def test_a_mostly_zero_state_is_stored_sparsely_and_read_back_exactly():
    """The difference of a 1000-class confusion matrix over one batch of 8 samples: 8 of 10^6 entries are not zero;
    the record holds them (index, value) instead of 8 MB, reads back ``==``, and a changed value is refused."""
    import io

    counts = torch.zeros(1000, 1000, dtype=torch.int64)
    counts[torch.arange(8), torch.arange(8) * 7] = torch.arange(1, 9)
    floats = torch.zeros(5000, dtype=torch.float64)  # floats stay dense (-0.0 must come back -0.0)
    floats[3] = -0.0
    w = Window(start=0, end=8, spans=torch.tensor([[0, 0, 8]]), runs=torch.tensor([[0, 8]]),
               states={"confusion": counts, "s": floats, "n": torch.tensor([8])},
               leaf_batches=torch.zeros(0, dtype=torch.int64), leaf_values=torch.zeros(0, 0, dtype=torch.float64),
               digests=torch.zeros(0, dtype=torch.int64))
    data = w.to_tensors()
    assert "confusion" not in data["states"] and data["sparse"]["confusion/index"].numel() == 8
    buf = io.BytesIO()
    torch.save(data, buf)
    assert buf.tell() < 100_000  # 8 MB dense
    back = Window.from_tensors(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert set(back.states) == {"confusion", "s", "n"}
    assert torch.equal(back.states["confusion"], counts) and back.states["confusion"].dtype == torch.int64
    assert torch.equal(back.states["s"], floats) and torch.signbit(back.states["s"][3])
    data["sparse"]["confusion/values"] = data["sparse"]["confusion/values"] + 1
    with pytest.raises(ValueError, match="digest"):
        Window.from_tensors(data)


def test_skipped_ids_travel_in_windows_also_a_wholly_skipped_batch():
    """Streamed data skips samples that do not decode (``Evaluator.skip``): a window carries them in ``skipped``
    and in its runs, also a batch skipped whole (no ``process`` call) and one skipped in part; an evaluator
    that adds those windows and evaluates the other batches covers every id once, lists the same skipped ids
    and gives the same metrics as the evaluator that saw everything."""
    dropped = {2: None, 5: {41, 43}}  # batch 2 wholly skipped; batch 5 loses ids 41 and 43

    def feed(ev, batches, take: bool):
        windows = []
        for index, x, y, ids in batches:
            keep = torch.ones(len(ids), dtype=torch.bool)
            if index in dropped:
                keep = torch.tensor([dropped[index] is not None and int(i) not in dropped[index] for i in ids])
                ev.skip(ids[~keep])
            if keep.any():
                ev.process(index, x[keep], y[keep], ids[keep])
            if take:
                windows.append(ev.take_window())
        return [w for w in windows if w is not None]

    full = Evaluator(_metric(), bitwise=True)
    full.windows = True
    windows = feed(full, _batches(), take=True)
    full.finish_local()
    assert [w.skipped.tolist() for w in windows if w.skipped.numel()] == [list(range(16, 24)), [41, 43]]
    assert all(w.runs.shape[0] == 1 for w in windows)  # each window's ids are one run [start, end)
    replay = [w for w in windows if w.start // B in (1, 2, 5, 9)]  # the skipped batches among them
    part = Evaluator(_metric(), bitwise=True)
    part.schedule(replay)
    feed(part, [b for b in _batches() if b[0] not in (1, 2, 5, 9)], take=False)
    part.finish_local()
    assert part.coverage.runs().tolist() == [[0, N]] == full.coverage.runs().tolist()
    assert sorted(part.skipped_recorded) == list(range(16, 24)) + [41, 43]
    assert part.metric.compute() == full.metric.compute()
