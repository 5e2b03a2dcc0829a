"""The movielens task without Flower: ratings.dat loading, the synthetic twin, the NCF
splits, per-user partitions, NeuMF, the AUC / HR@10 metrics, train and evaluate."""

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

import tasks
from config.options import ConfigError
from tasks.base import DPSGD, EVAL_LOSS, NUM_EXAMPLES, TRAIN_LOSS, LocalTraining
from tasks.movielens import EVAL_AUC, EVAL_HR10, MovieLensTask, clear_caches
from tasks.movielens.data import (
    CENTRAL_TEST,
    LOCAL_TEST,
    MIN_RATINGS,
    NOT_POSITIVE,
    TRAIN,
    distinct_negatives,
    generate_synthetic,
    leave_one_out,
    read_ratings,
    sample_negatives,
)
from tasks.movielens.model import build_model, heldout_auc, hit_rate

USERS, ITEMS = 300, 200
CONFIG = {"seed": 42, "movielens.synthetic-users": USERS, "movielens.synthetic-items": ITEMS}
KEY = r"movielens\.data-path"


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _pairs(users: np.ndarray, items: np.ndarray) -> set[tuple[int, int]]:
    return set(zip(users.tolist(), items.tolist(), strict=True))


# --- synthetic generator ------------------------------------------------------------


def test_synthetic_is_deterministic_per_seed():
    # Execute
    first, again, other = (generate_synthetic(USERS, ITEMS, s) for s in (3, 3, 4))

    # Assert
    for name in ("users", "items", "ratings", "timestamps"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.items, other.items)


def test_synthetic_counts_ratings_and_ids():
    # Execute
    ratings = generate_synthetic(USERS, ITEMS, seed=5)

    # Assert
    per_user = np.bincount(ratings.users, minlength=USERS)
    assert per_user.min() >= MIN_RATINGS and per_user.max() <= ITEMS // 2
    assert np.median(per_user) < per_user.mean()  # right-skewed (power-law-ish) counts
    assert set(np.unique(ratings.ratings)) == {1, 2, 3, 4, 5}
    assert len(set(zip(ratings.users, ratings.items, strict=True))) == len(ratings)
    assert ratings.num_users == USERS and ratings.num_items == ITEMS
    assert ratings.user_ids[0] == 1 and ratings.item_ids[-1] == ITEMS  # 1-based as ML-1M
    assert 0.45 < np.mean(ratings.ratings >= 4) < 0.7  # ML-1M: 57 % are 4 or 5


# --- ratings.dat ----------------------------------------------------------------------


def test_read_ratings_file_exactly(tmp_path):
    # Prepare: a directory holding ratings.dat, a blank line and a CRLF line
    lines = "7::1193::5::978300760\n7::661::3::978302109\r\n\n12::1193::4::978301968\n"
    (tmp_path / "ratings.dat").write_text(lines)

    # Execute
    ratings = read_ratings(str(tmp_path))

    # Assert
    assert ratings.user_ids[ratings.users].tolist() == [7, 7, 12]
    assert ratings.item_ids[ratings.items].tolist() == [1193, 661, 1193]
    assert ratings.users.tolist() == [0, 0, 1] and ratings.items.tolist() == [1, 0, 1]
    assert ratings.ratings.tolist() == [5, 3, 4]
    assert ratings.timestamps.tolist() == [978300760, 978302109, 978301968]
    assert ratings.source == str(tmp_path / "ratings.dat")


@pytest.mark.parametrize(
    ("content", "match"),
    [("1::2::5::10\n1::3::4\n", "line 2 is malformed.*UserID::MovieID::Rating::Timestamp"),
     ("1::2::5::10\n1::3::x::11\n", "line 2 is malformed"),
     ("1,2,5,10\n", "line 1 is malformed"),
     ("1::2::5::10\n1::3::6::11\n", "line 2 has rating 6"),
     ("1::2::5::10\n1::3::4::11\n1::2::3::12\n", r"movie 2 more than once \(lines \[1, 3\]\)"),
     ("\n\n", "no ratings")],
)  # fmt: skip
def test_bad_file_raises_config_error_naming_key_path_and_line(tmp_path, content, match):
    # Prepare
    path = tmp_path / "bad.dat"
    path.write_text(content)

    # Execute / Assert
    with pytest.raises(ConfigError, match=f"{KEY}.*bad.dat.*{match}"):
        read_ratings(str(path))


def test_missing_file_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match=f"{KEY}.*nowhere.*no such file"):
        read_ratings(str(tmp_path / "nowhere"))


def test_file_too_small_for_the_ncf_protocol_is_a_config_error(tmp_path):
    # Prepare: 3 movies in all, but each user needs 99 unrated ones
    (tmp_path / "ratings.dat").write_text("1::10::5::1\n1::11::4::2\n2::12::5::3\n")
    task = MovieLensTask({"movielens.data-path": str(tmp_path)})

    # Execute / Assert
    with pytest.raises(ConfigError, match=f"{KEY}.*user 1 rated 2 of the 3 movies.*99"):
        task.load_central_test()
    clear_caches()


# --- NCF splits and negatives ---------------------------------------------------------


def test_leave_one_out_roles_by_time_then_position():
    # Prepare: user 0 has 4 positives (two tied at t=9) and a low rating; user 1 has
    # 2 positives; user 2 has 1.
    users = np.array([0, 0, 0, 0, 0, 1, 1, 2])
    times = np.array([5, 9, 1, 9, 20, 3, 2, 7])
    positive = np.array([1, 1, 1, 1, 0, 1, 1, 1], dtype=bool)

    # Execute
    role = leave_one_out(users, times, positive)

    # Assert: user 0's latest positives are rows 3 (t=9, later row) then 1
    expected = [TRAIN, LOCAL_TEST, TRAIN, CENTRAL_TEST, NOT_POSITIVE, CENTRAL_TEST, TRAIN, TRAIN]
    assert role.tolist() == expected


def test_distinct_negatives_cover_exactly_the_unrated_items():
    # Prepare
    rng = np.random.default_rng(0)

    # Execute: ask for all 4 unrated items of a 7-item catalogue
    picks = distinct_negatives(np.array([1, 3, 4]), 7, 4, rng)

    # Assert
    assert sorted(picks.tolist()) == [0, 2, 5, 6]


def test_sample_negatives_is_uniform_over_unrated_items():
    # Prepare: user 1 rated items 0-4 of 10 (keys 10..14); user 0 rated item 9
    keys = np.array([9, 10, 11, 12, 13, 14])
    rng = np.random.default_rng(1)

    # Execute
    negatives = sample_negatives(np.array([1, 0]), keys, 10, 5000, rng)

    # Assert: each of the 5 unrated items ~ Binomial(5000, 0.2): mean 1000, sd 28.3
    counts = np.bincount(negatives[0], minlength=10)
    assert counts[:5].sum() == 0
    assert np.all(np.abs(counts[5:] - 1000) < 5 * 28.3)
    assert 9 not in negatives[1]
    with pytest.raises(ValueError, match=r"users \[1\] rated every item"):
        sample_negatives(np.array([1]), np.arange(10, 20), 10, 1, rng)


# --- partitions -------------------------------------------------------------------------


def test_partitions_cover_users_and_never_overlap_the_central_test():
    # Prepare
    task = MovieLensTask(CONFIG)

    # Execute
    parts = [task.load_partition(p, 7) for p in range(7)]
    central = task.load_central_test().test

    # Assert
    users = np.concatenate([p.users for p in parts])
    assert sorted(users.tolist()) == list(range(USERS))
    assert [len(p.users) for p in parts] == [43] * 6 + [42]  # ranks p, p + 7, ...
    central_pairs = _pairs(central.users, central.positives)
    assert len(central) == USERS  # every synthetic user has >= 2 positives
    for part in parts:
        train = _pairs(part.train.users, part.train.items)
        local = _pairs(part.test.users, part.test.positives)
        assert set(part.train.users) <= set(part.users) and set(part.test.users) <= set(part.users)
        assert not train & central_pairs and not local & central_pairs and not train & local
        assert not _pairs(part.test.users[:, None].repeat(99, 1).ravel(),
                          part.test.negatives.ravel()) & train  # fmt: skip
    assert task.load_partition(3, 7) is parts[3]  # cached per process


def test_one_user_per_client_when_partitions_equal_users():
    # Prepare
    task = MovieLensTask(CONFIG)

    # Execute
    owners = [task.load_partition(p, USERS).users for p in range(USERS)]

    # Assert
    assert all(len(u) == 1 for u in owners)
    assert sorted(int(u[0]) for u in owners) == list(range(USERS))
    with pytest.raises(ValueError, match=r"num_partitions must be in \[1, 300\]"):
        task.load_partition(0, USERS + 1)
    with pytest.raises(ValueError, match="partition_id 5"):
        task.load_partition(5, 5)


# --- metrics --------------------------------------------------------------------------


def test_heldout_auc_equals_sklearn_roc_auc_with_ties():
    # Prepare: scores rounded to one decimal, so ties are common
    rng = np.random.default_rng(2)
    positive = rng.normal(0.5, 1.0, 50).round(1)
    negatives = rng.normal(0.0, 1.0, (50, 99)).round(1)
    labels = np.r_[1, np.zeros(99)]

    # Execute
    auc = heldout_auc(positive, negatives)

    # Assert
    expected = [
        roc_auc_score(labels, np.r_[p, n]) for p, n in zip(positive, negatives, strict=True)
    ]
    np.testing.assert_allclose(auc, expected, rtol=0, atol=1e-12)


def test_auc_and_hit_rate_by_hand():
    # Prepare: positive 0.5 against 4 negatives
    positive = np.array([0.5, 0.5])
    negatives = np.array([[0.1, 0.5, 0.9, 0.2], [0.6, 0.7, 0.8, 0.9]])

    # Execute / Assert: 2 below + 1 tie (1/2) of 4; then none below
    np.testing.assert_allclose(heldout_auc(positive, negatives), [2.5 / 4, 0.0])
    # at least as high: 2 (row 0) and 4 (row 1)
    assert hit_rate(positive, negatives, 3).tolist() == [1.0, 0.0]
    assert hit_rate(positive, negatives, 2).tolist() == [0.0, 0.0]
    assert hit_rate(positive, negatives, 5).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="negatives must have shape"):
        heldout_auc(positive, negatives[:1])


# --- model, train and evaluate ----------------------------------------------------------


def test_neumf_shape_parameter_count_and_seeded_init():
    # Prepare
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)

    # Execute
    model, same, other = build_model(5, 7, 4, 1), build_model(5, 7, 4, 1), build_model(5, 7, 4, 2)
    after = torch.rand(1)
    logits = model(torch.tensor([0, 4]), torch.tensor([6, 0]))

    # Assert: 2 x (5 + 7) x 4 embeddings; MLP 8->8->4; predict 8->1
    assert sum(p.numel() for p in model.parameters()) == 96 + (64 + 8) + (32 + 4) + (8 + 1)
    assert logits.shape == (2,)
    assert torch.equal(_weights(model), _weights(same))
    assert not torch.equal(_weights(model), _weights(other))
    assert torch.equal(before, after)  # the global RNG is untouched


def test_untrained_auc_is_chance_and_trained_ncf_learns_the_structure():
    # Prepare
    task = MovieLensTask({**CONFIG, "movielens.local-epochs": 3, "movielens.lr": 5e-3})
    everyone, central = task.load_partition(0, 1), task.load_central_test()

    # Execute
    chance = [task.evaluate(task.build_model(s), central) for s in range(10)]
    model = task.build_model(0)
    task.train(model, everyone, LocalTraining(server_round=1, seed=0))
    trained = task.evaluate(model, central)

    # Assert: one untrained model's AUC has sd ~0.022 over inits (measured, 40 seeds);
    # the mean of 10 is within 0.03 (~4 standard errors) of chance.
    assert abs(np.mean([m[EVAL_AUC] for m in chance]) - 0.5) < 0.03
    assert trained[EVAL_AUC] > 0.75  # ~0.83 observed
    # HR@10 by chance is 10 / 100; 10 models x 300 users: standard error ~0.006
    assert abs(np.mean([m[EVAL_HR10] for m in chance]) - 0.1) < 0.05
    assert trained[EVAL_HR10] > 0.3  # ~0.53 observed


def test_train_and_evaluate_metric_keys_and_determinism():
    # Prepare
    task = MovieLensTask(CONFIG)
    part = task.load_partition(1, 4)
    models = [task.build_model(0) for _ in range(3)]

    # Execute
    results = [
        task.train(m, part, LocalTraining(1, seed=s))
        for m, s in zip(models, (7, 7, 8), strict=True)
    ]
    local, central = (
        task.evaluate(models[0], part),
        task.evaluate(models[0], task.load_central_test()),
    )

    # Assert
    assert results[0] == results[1] and results[0] != results[2]
    assert set(results[0]) == {NUM_EXAMPLES, TRAIN_LOSS}
    assert results[0][NUM_EXAMPLES] == len(part.train) == task.train_size(part)
    assert torch.equal(_weights(models[0]), _weights(models[1]))
    assert not torch.equal(_weights(models[0]), _weights(models[2]))
    for metrics, count in ((local, len(part.users)), (central, USERS)):
        assert set(metrics) == {NUM_EXAMPLES, EVAL_LOSS, EVAL_AUC, EVAL_HR10}
        assert metrics[NUM_EXAMPLES] == count  # >= 3 positives each: one local test each
        assert 0 <= metrics[EVAL_AUC] <= 1 and 0 <= metrics[EVAL_HR10] <= 1
        assert 0 < metrics[EVAL_LOSS] < 2


def test_only_the_clients_user_rows_change():
    # Prepare
    task = MovieLensTask(CONFIG)
    part = task.load_partition(2, 5)
    model = task.build_model(0)
    start = model.user_gmf.weight.detach().clone(), model.user_mlp.weight.detach().clone()
    others = np.setdiff1d(np.arange(USERS), part.users)

    # Execute: with the FedProx term on
    task.train(model, part, LocalTraining(1, seed=3, proximal_mu=0.5))

    # Assert
    for table, before in zip((model.user_gmf, model.user_mlp), start, strict=True):
        after = table.weight.detach()
        assert torch.equal(after[others], before[others])
        assert not torch.equal(after[part.users], before[part.users])


# --- options and registry ---------------------------------------------------------------


def test_defaults_registry_and_class_attributes():
    # Execute
    cfg = MovieLensTask({}).config

    # Assert
    assert (cfg.synthetic_users, cfg.synthetic_items, cfg.positive_threshold) == (600, 400, 4)
    assert (cfg.negatives, cfg.embedding_dim, cfg.batch_size) == (4, 16, 256)
    assert (cfg.local_epochs, cfg.lr, cfg.data_path, cfg.seed) == (1, 1e-3, "", 42)
    assert tasks.get("movielens") is MovieLensTask
    assert MovieLensTask.EPOCHS_KEY == "movielens.local-epochs"
    assert MovieLensTask.SUPPORTS_DP_SGD is False
    assert MovieLensTask({}).num_partitions() is None
    assert MovieLensTask(CONFIG).data_source == "synthetic (seed 42, 300 users, 200 items)"


@pytest.mark.parametrize(
    ("key", "value"),
    [("movielens.positive-threshold", 6), ("movielens.negatives", 0),
     ("movielens.negatives", 100), ("movielens.synthetic-items", 100),
     ("movielens.lr", 0), ("movielens.device", "tpu"), ("movielens.data-path", 3),
     ("movielens.embedding-dim", 0), ("movielens.local-epochs", 0)],
)  # fmt: skip
def test_invalid_option_raises_config_error_naming_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        MovieLensTask({key: value})


def test_dp_sgd_is_refused():
    # Prepare
    task = MovieLensTask(CONFIG)
    local = LocalTraining(1, seed=0, dp_sgd=DPSGD(1.0, 1.0, 1e-5))

    # Execute / Assert
    with pytest.raises(ConfigError, match="movielens does not support dp-sgd"):
        task.train(task.build_model(0), task.load_partition(0, 2), local)
