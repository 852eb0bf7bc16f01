"""Datasets: digits' shapes, scaling and split; deterministic batches; synthetic teacher data."""
from __future__ import annotations

import pytest
import torch

from search.data import ArrayDataset, DataError, Dataset, Digits, Synthetic, digits_split


@pytest.fixture(scope="module")
def digits() -> Digits:
    return Digits(seed=0)


def test_digits_shapes_types_and_split(digits: Digits) -> None:
    assert isinstance(digits, Dataset)
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    assert digits.x_train.dtype == torch.float32 and digits.y_train.dtype == torch.int64
    assert digits.train_size + digits.val_size == 1797
    assert digits.val_size == 360  # 20 %, stratified: every class in both parts
    assert set(digits.y_val.tolist()) == set(range(10)) == set(digits.y_train.tolist())
    # normalized with the training set's statistics
    assert abs(float(digits.x_train.mean())) < 1e-4 and abs(float(digits.x_train.std()) - 1) < 1e-3
    # the split is fixed by split_seed, not by the run's seed
    other = Digits(seed=5)
    assert torch.equal(other.x_val, digits.x_val) and torch.equal(other.y_train, digits.y_train)
    assert not torch.equal(Digits(split_seed=1).y_val, digits.y_val)


def test_the_digits_cache_gives_scikit_learns_split_and_remakes_a_bad_file(tmp_path, monkeypatch) -> None:
    """The cached arrays are scikit-learn's split bit for bit; a cache file that cannot be read
    (cut short by a crash, say) is made again, and a cache that cannot be written is skipped."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x, y = (d.images.astype("float32") / 16.0)[:, None], d.target.astype("int64")
    want = train_test_split(x, y, test_size=0.25, random_state=3, stratify=y)
    first = digits_split(0.25, 3, tmp_path)
    (path,) = tmp_path.glob("digits-*.npz")
    again = digits_split(0.25, 3, tmp_path)
    for a, b, c in zip(want, first, again):
        assert a.dtype == b.dtype == c.dtype and (a == b).all() and (a == c).all()
    assert digits_split(0.2, 3, tmp_path)[1].shape[0] != first[1].shape[0]  # the key has the settings
    path.write_bytes(path.read_bytes()[:100])
    assert all((a == b).all() for a, b in zip(want, digits_split(0.25, 3, tmp_path)))
    assert len(path.read_bytes()) > 100  # made again
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert all((a == b).all() for a, b in zip(want, digits_split(0.25, 3, blocked / "cache")))
    monkeypatch.setenv("PIPENAS_CACHE", str(tmp_path / "env"))  # the run's cache dir by default
    digits_split(0.25, 3)
    assert len(list((tmp_path / "env").glob("digits-*.npz"))) == 1


def test_train_batches_are_a_pure_function_of_seed_and_step(digits: Digits) -> None:
    again = Digits(seed=0)
    for step in (0, 1, 21, 22, 500, 3):
        x, y = digits.train_batch(step, 64)
        x2, y2 = again.train_batch(step, 64)
        assert x.shape == (64, 1, 8, 8) and y.shape == (64,)
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(digits.train_batch(0, 64)[1], Digits(seed=1).train_batch(0, 64)[1])


def test_an_epoch_visits_every_sample_once() -> None:
    x = torch.arange(10, dtype=torch.float32).view(10, 1)
    ds = ArrayDataset(x, torch.arange(10), x[:2], torch.arange(2), num_classes=10, seed=3)
    epoch0 = torch.cat([ds.train_batch(s, 3)[1] for s in range(3)])  # 3 batches of 3, one dropped
    assert len(set(epoch0.tolist())) == 9
    epoch1 = torch.cat([ds.train_batch(s, 3)[1] for s in range(3, 6)])
    assert not torch.equal(epoch0, epoch1)  # each epoch has its own permutation
    assert torch.equal(ds.train_batch(4, 3)[1], ds.train_batch(4, 3)[1])


def test_val_and_calib_batches(digits: Digits) -> None:
    val = digits.val_batches(100)
    assert [len(y) for _, y in val] == [100, 100, 100, 60]
    assert torch.equal(torch.cat([y for _, y in val]), digits.y_val)
    calib = digits.calib_batches(3, 32)
    assert len(calib) == 3 and all(x.shape == (32, 1, 8, 8) for x, _ in calib)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(calib, digits.calib_batches(3, 32)))
    assert digits.calib_batches(0, 32) == []


def test_bad_batch_sizes_name_the_field(digits: Digits) -> None:
    with pytest.raises(DataError, match=r"train.batch_size: expected an integer between 1 and 1437 .*found 5000"):
        digits.train_batch(0, 5000)
    with pytest.raises(DataError, match="search.val_batch_size: expected a positive integer, found 0"):
        digits.val_batches(0)
    with pytest.raises(DataError, match=r"data.val_fraction: expected a number in \(0, 1\), found 1.5"):
        Digits(val_fraction=1.5)


def test_synthetic_is_fixed_by_teacher_seed_and_learnable() -> None:
    a = Synthetic(input_shape=(3, 4, 4), num_classes=5, size=600, val_size=200, seed=0, teacher_seed=2)
    b = Synthetic(input_shape=(3, 4, 4), num_classes=5, size=600, val_size=200, seed=9, teacher_seed=2)
    assert a.input_shape == (3, 4, 4) and a.num_classes == 5
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_val, b.y_val)
    assert not torch.equal(a.train_batch(0, 50)[0], b.train_batch(0, 50)[0])  # batch order from seed
    assert len(set(a.y_train.tolist())) >= 4
    # labels come from a linear teacher: least squares on one-hot targets recovers most of them
    x = torch.cat([a.x_train.flatten(1), torch.ones(600, 1)], 1)
    w = torch.linalg.lstsq(x, torch.nn.functional.one_hot(a.y_train, 5).float()).solution
    xv = torch.cat([a.x_val.flatten(1), torch.ones(200, 1)], 1)
    assert float(((xv @ w).argmax(-1) == a.y_val).float().mean()) > 0.6
    with pytest.raises(DataError, match=r"data.input_shape: expected a list of positive integers, found \[3, 0\]"):
        Synthetic(input_shape=(3, 0))


def test_rows_of_a_batch_are_that_part_of_the_whole(digits: Digits) -> None:
    """What a pipeline replica reads (its micro-batches' rows) is exactly its part of the batch."""
    for step in (0, 7, 40):
        x, y = digits.train_batch(step, 64)
        for rows in (range(0, 32), range(32, 64), range(16, 48)):
            xr, yr = digits.train_batch(step, 64, rows=rows)
            assert torch.equal(xr, x[rows.start:rows.stop]) and torch.equal(yr, y[rows.start:rows.stop])
