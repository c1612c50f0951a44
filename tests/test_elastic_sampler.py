"""ddl.torch.elastic.ElasticSampler without a job: sharding, and the exactly-once contract
across changes of the world mid-epoch (rollbacks to the last commit included), simulated
in one process with explicit ``num_replicas``/``rank`` (a world of samplers stepping in
lockstep, as synchronous training does; ranks whose share ran out sit the step out, as
after ``ddl.join()``)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from ddl.torch.elastic import ElasticSampler  # noqa: E402


def _world(n_items, n, state=None, shuffle=True, seed=3):
    samplers = [ElasticSampler(range(n_items), shuffle=shuffle, seed=seed, num_replicas=n,
                               rank=r) for r in range(n)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    return samplers


@pytest.mark.parametrize("n_items", [0, 1, 7, 10, 64])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shards_are_disjoint_cover_everything_and_differ_by_at_most_one(n_items, n):
    samplers = _world(n_items, n)
    shards = [list(s) for s in samplers]
    assert sorted(i for shard in shards for i in shard) == list(range(n_items))
    lengths = [len(s) for s in samplers]
    assert lengths == [len(shard) for shard in shards]
    # the first (n_items % n) ranks take one more; rank 0 is always among the longest
    assert lengths == [n_items // n + (r < n_items % n) for r in range(n)]


def test_order_is_the_same_on_every_rank_and_changes_with_the_epoch():
    a, b = _world(50, 2), _world(50, 2)
    assert [list(s) for s in a] == [list(s) for s in b]
    first = a[0].remaining_indices.tolist()
    assert sorted(first) == list(range(50)) and first != list(range(50))
    for s in a:
        s.set_epoch(1)
    assert a[0].remaining_indices.tolist() != first
    assert sorted(a[0].remaining_indices.tolist()) == list(range(50))
    plain = _world(10, 3, shuffle=False)
    assert [list(s) for s in plain] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_record_batch_marks_the_batch_of_every_rank():
    samplers = _world(23, 3)
    shards = [list(s) for s in samplers]
    samplers[1].record_batch(0, 4)
    assert samplers[1].processed_num == 12
    samplers[1].record_batch(1, 4)  # batch 1, size 4: elements 4..7 of each rank's shard
    assert samplers[1].processed_indices == {i for shard in shards for i in shard[:8]}
    # each call marks the world's next batch, whatever its batch_idx (as Horovod's)
    again = _world(23, 3)
    again[0].record_batch(5, 4)
    assert again[0].processed_indices == {i for shard in shards for i in shard[:4]}
    assert (again[0].processed_num, again[0].num_samples, again[0].total_size) == (12, 8, 23)
    # Horovod's state (a count of the epoch's order) loads too
    horovods = _world(23, 2, {"epoch": 0, "processed_num": 12})
    assert horovods[0].processed_indices == again[0].processed_indices
    # a new world carries on with the rest, on any number of ranks
    after = _world(23, 2, samplers[1].state_dict())
    left = [i for s in after for i in s]
    assert sorted(left) == sorted(set(range(23)) - samplers[1].processed_indices)


def _simulate_epoch(rng, n_items, sizes, batch_size, commit_every, shuffle=True):
    """One epoch across the worlds of ``sizes``; each world but the last ends either by a
    failure (a rank lost some steps after its last commit: every survivor rolls back) or by
    a host update (raised at a commit: no rollback). Returns the indices whose training
    survived (processed and committed), in order."""
    committed_state = _world(n_items, sizes[0], shuffle=shuffle)[0].state_dict()
    effective = []
    for k, n in enumerate(sizes):
        samplers = _world(n_items, n, committed_state, shuffle=shuffle)
        # new workers join with a fresh sampler; sync() would union the processed sets:
        # every survivor restored the same committed state, so the union is that state
        batches = [[list(s)[i:i + batch_size] for i in range(0, len(s), batch_size)]
                   for s in samplers]
        steps = max(len(b) for b in batches) if batches else 0
        last = k == len(sizes) - 1
        stop = steps if last else rng.randrange(0, steps + 1)
        pending = []
        for step in range(steps):
            if step == stop:
                break
            for r, s in enumerate(samplers):
                if step < len(batches[r]):  # the others have joined
                    pending.extend(batches[r][step])
                    s.record_batch(step, batch_size)
            if (step + 1) % commit_every == 0:
                committed_state = samplers[0].state_dict()
                effective.extend(pending)
                pending = []
        if last:
            committed_state = samplers[0].state_dict()
            effective.extend(pending)
        elif rng.random() < 0.5:  # a host update at a commit: what was done, stays
            committed_state = samplers[0].state_dict()
            effective.extend(pending)
        # else a failure: pending work is rolled back
    return effective


@pytest.mark.parametrize("seed", range(40))
def test_every_index_is_processed_exactly_once_across_changes_of_the_world(seed):
    rng = random.Random(seed)
    n_items = rng.randrange(1, 120)
    sizes = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 6))]
    effective = _simulate_epoch(rng, n_items, sizes, batch_size=rng.randrange(1, 9),
                                commit_every=rng.randrange(1, 4), shuffle=seed % 2 == 0)
    assert sorted(effective) == list(range(n_items)), (n_items, sizes)


def test_through_a_dataloader_with_uneven_shares():
    """A real DataLoader over the sampler: 2 ranks, 2 steps, then 3 ranks finish the
    epoch; 21 items left for 3 ranks at batch size 4 gives no rank a short share, 10 items
    for 3 ranks gives rank 0 one batch more (it runs alone, as after ``ddl.join()``)."""
    data = list(range(37))
    seen = []
    world = _world(37, 2)
    loaders = [torch.utils.data.DataLoader(data, batch_size=4, sampler=s) for s in world]
    for step, batches in enumerate(zip(*loaders)):
        for s, b in zip(world, batches):
            seen.extend(b.tolist())
            s.record_batch(step, 4)
        if step == 1:
            break
    state = world[0].state_dict()
    world = _world(37, 3, state)
    assert [len(s) for s in world] == [7, 7, 7]
    loaders = [torch.utils.data.DataLoader(data, batch_size=4, sampler=s) for s in world]
    counts = [len(loader) for loader in loaders]
    assert counts == [2, 2, 2]
    for loader in loaders:
        for b in loader:
            seen.extend(b.tolist())
    assert sorted(seen) == data
    last = _world(10, 3)
    assert [len(s) for s in last] == [4, 3, 3]
    assert [len(torch.utils.data.DataLoader(range(10), batch_size=3, sampler=s))
            for s in last] == [2, 1, 1]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="give both num_replicas and rank or neither"):
        ElasticSampler(range(4), num_replicas=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, num_replicas\), got rank=2, "
                                         r"num_replicas=2"):
        ElasticSampler(range(4), num_replicas=2, rank=2)
    s = ElasticSampler(range(4), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="batch_idx=-1, batch_size=4"):
        s.record_batch(-1, 4)
    with pytest.raises(ValueError, match="batch_idx=0, batch_size=0"):
        s.record_batch(0, 0)
    with pytest.raises(ValueError, match=r"indices \[4\] are out of range for a dataset of 4"):
        s.record_indices([1, 4])


def test_state_dict_round_trip_and_set_epoch_clears():
    s = ElasticSampler(range(20), seed=5, num_replicas=2, rank=1)
    s.set_epoch(3)
    s.record_indices([2, 5])
    copy = ElasticSampler(range(20), seed=5, num_replicas=2, rank=1)
    copy.load_state_dict(s.state_dict())
    saved = copy.state_dict()
    assert saved["epoch"] == 3 and saved["processed_indices"].tolist() == [2, 5]
    assert saved["own_indices"].tolist() == [2, 5]  # recorded by this rank: sync adds them
    other = ElasticSampler(range(20), seed=5, num_replicas=2, rank=0)
    other.record_batch(0, 2)
    other.record_indices([2])
    assert other.state_dict()["own_indices"].tolist() == [2]  # a batch is every rank's
    other.load_state_dict({"epoch": 3, "processed_indices": [2, 5]})  # Horovod's: no own
    assert other.processed_indices == {2, 5} and not len(other.state_dict()["own_indices"])
    assert not {2, 5} & set(copy.remaining_indices) and {2, 5} <= set(s.remaining_indices)
    s.reset()  # recorded indices leave the shares at the next reset, not before
    assert list(copy) == list(s)
    s.set_epoch(4)
    assert s.processed_indices == set() and len(s.remaining_indices) == 20


def test_a_bad_state_changes_nothing():
    s = ElasticSampler(range(10), seed=1, num_replicas=1, rank=0)
    s.record_batch(0, 3)
    before = s.state_dict()
    with pytest.raises(ValueError, match=r"indices \[12\] are out of range for a dataset of 10"):
        s.load_state_dict({"epoch": 7, "processed_indices": [1, 12]})
    after = s.state_dict()
    assert after["epoch"] == before["epoch"] == 0
    assert after["processed_indices"].tolist() == before["processed_indices"].tolist()
