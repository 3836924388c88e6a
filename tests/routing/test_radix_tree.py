"""The approximate prefix tree against a brute-force reference (sets of inserted keys per instance)."""

from __future__ import annotations

import random

import pytest

from psrl.router.policies.radix_tree import RadixTree, common_prefix_len, encode_key
from psrl.router.registry import InstanceId

A, B, C = InstanceId("a", 0), InstanceId("b", 0), InstanceId("b", 1)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


class Reference:
    """Every key inserted per instance, with the last time each prefix was touched."""

    def __init__(self) -> None:
        self.touched: dict[InstanceId, dict[tuple[int, ...], float]] = {}

    def insert(self, key: tuple[int, ...], iid: InstanceId, t: float) -> None:
        prefixes = self.touched.setdefault(iid, {})
        for n in range(1, len(key) + 1):
            prefixes[key[:n]] = t

    def match(self, key: tuple[int, ...]) -> dict[InstanceId, int]:
        out = {}
        for iid, prefixes in self.touched.items():
            # Prefix-closed, so the longest held prefix of `key` is the last one found walking up from 1.
            n = 0
            while n < len(key) and key[: n + 1] in prefixes:
                n += 1
            if n:
                out[iid] = n
        return out

    def size_of(self, iid: InstanceId) -> int:
        return len(self.touched.get(iid, {}))


def _random_key(rng: random.Random, stems: list[tuple[int, ...]], alphabet: int) -> tuple[int, ...]:
    # Share prefixes often, so edges get split at all depths.
    stem = rng.choice(stems) if stems and rng.random() < 0.7 else ()
    stem = stem[: rng.randint(0, len(stem))]
    return stem + tuple(rng.randrange(alphabet) for _ in range(rng.randint(0 if stem else 1, 12)))


def _retained(tree: RadixTree, keys: list[tuple[int, ...]], iid: InstanceId) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    for key in keys:
        m = tree.match(key).get(iid, 0)
        out.update(key[:n] for n in range(1, m + 1))
    return out


def test_common_prefix_len() -> None:
    assert common_prefix_len(b"abc", b"zabd", 1) == 2
    assert common_prefix_len(b"abc", b"abcd", 0) == 3
    assert common_prefix_len(b"abc", b"ab", 0) == 2
    assert common_prefix_len(b"x", b"y", 0) == 0
    # Token ids: whole uint32 elements only, even when the mismatching one shares its low bytes.
    edge, _ = encode_key([1, 2, 3, 256])
    key, width = encode_key([9, 1, 2, 3, 257])
    assert width == 4 and common_prefix_len(edge, key, 4, width) == 12


def test_insert_match_split_and_sizes() -> None:
    tree = RadixTree(Clock())
    tree.insert([1, 2, 3, 4], A)
    tree.insert([1, 2, 5], B)
    tree.insert([1, 2, 3, 4, 6], B)
    assert tree.match([1, 2, 3, 4, 6, 7]) == {A: 4, B: 5}
    assert tree.match([1, 2, 3, 9]) == {A: 3, B: 3}
    assert tree.match([1, 2, 5, 0]) == {A: 2, B: 3}
    assert tree.match([2]) == {}
    assert tree.match([]) == {}
    assert tree.size_of(A) == 4 and tree.size_of(B) == 6 and tree.size_of(C) == 0
    tree.insert([1, 2, 3, 4], A)  # again: nothing new
    assert tree.size_of(A) == 4


def test_bytes_keys_and_one_kind_per_tree() -> None:
    tree = RadixTree(Clock())
    tree.insert(b"hello world", A)
    tree.insert(bytearray(b"hello there"), B)
    assert tree.match(b"hello wonder") == {A: 8, B: 6}
    assert tree.size_of(A) == 11
    assert tree.match([104, 101]) == {}  # token ids never match text bytes
    with pytest.raises(ValueError, match="not both"):
        tree.insert([104, 101], A)


def test_large_token_ids() -> None:
    tree = RadixTree(Clock())
    tree.insert([151_643, 2**32 - 1, 7], A)
    tree.insert([151_643, 2**32 - 1, 8, 9], B)
    assert tree.match([151_643, 2**32 - 1, 8]) == {A: 2, B: 3}
    assert tree.size_of(B) == 4


@pytest.mark.parametrize("seed", range(8))
def test_random_against_reference(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    tree, ref = RadixTree(clock), Reference()
    ids = [A, B, C, InstanceId("d", 0)]
    stems: list[tuple[int, ...]] = []
    for _ in range(300):
        key = _random_key(rng, stems, alphabet=rng.choice((2, 4, 50)))
        stems.append(key)
        iid = rng.choice(ids)
        t = clock()
        tree.insert(list(key), iid, now=t)
        ref.insert(key, iid, t)
        query = _random_key(rng, stems, alphabet=4)
        assert tree.match(query) == ref.match(query)
    for iid in ids:
        assert tree.size_of(iid) == ref.size_of(iid)
    for key in stems:
        assert tree.match(key) == ref.match(key)


@pytest.mark.parametrize("seed", range(8))
def test_remove_instance_and_worker(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    tree, ref = RadixTree(clock), Reference()
    stems: list[tuple[int, ...]] = []
    for _ in range(200):
        key = _random_key(rng, stems, alphabet=3)
        stems.append(key)
        iid = rng.choice([A, B, C])
        t = clock()
        tree.insert(key, iid, now=t)
        ref.insert(key, iid, t)
    tree.remove_instance(A)
    ref.touched.pop(A, None)
    for key in stems:
        assert tree.match(key) == ref.match(key)
    assert tree.size_of(A) == 0
    tree.remove_worker("b")  # both ranks
    assert all(tree.match(k) == {} for k in stems)
    assert tree.instances() == []
    tree.remove_instance(A)  # unknown: no error


@pytest.mark.parametrize("seed", range(10))
def test_evict_keeps_the_most_recent_within_the_limit(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    tree, ref = RadixTree(clock), Reference()
    stems: list[tuple[int, ...]] = []
    for _ in range(150):
        key = _random_key(rng, stems, alphabet=3)
        stems.append(key)
        iid = rng.choice([A, B])
        t = clock()
        tree.insert(key, iid, now=t)
        ref.insert(key, iid, t)
    limit = ref.size_of(A) // 3
    size_b = tree.size_of(B)
    tree.evict(max(limit, size_b))  # B stays untouched
    assert tree.size_of(B) == size_b == len(_retained(tree, stems, B))
    kept = _retained(tree, stems, A)
    assert tree.size_of(A) == len(kept)
    if ref.size_of(A) > max(limit, size_b):
        assert 0 < tree.size_of(A) <= max(limit, size_b)
    touched = ref.touched[A]
    # Prefix-closed, and LRU: nothing evicted was used more recently than anything kept.
    assert all(p[:-1] in kept for p in kept if len(p) > 1)
    evicted = set(touched) - kept
    if evicted and kept:
        assert max(touched[p] for p in evicted) <= min(touched[p] for p in kept)
    # The tree still answers like a reference rebuilt from what was kept.
    survivors = Reference()
    survivors.touched = {A: {p: touched[p] for p in kept}, B: ref.touched[B]}
    for key in stems:
        assert tree.match(key) == survivors.match(key)


def test_evict_drops_oldest_leaf_first() -> None:
    clock = Clock()
    tree = RadixTree(clock)
    tree.insert([1, 2, 3, 4], A)  # t=1
    tree.insert([1, 2, 7, 8], A)  # t=2
    tree.insert([1, 2, 3, 4], B)  # shared with B
    assert tree.size_of(A) == 6
    tree.evict(5)
    assert tree.match([1, 2, 3, 4]) == {A: 2, B: 4}  # A's old leaf gone, B's copy kept
    assert tree.match([1, 2, 7, 8]) == {A: 4, B: 2}
    assert tree.size_of(A) == 4 and tree.size_of(B) == 4
    tree.evict(0)
    assert tree.size_of(A) == 0 and tree.size_of(B) == 0
    assert tree.match([1, 2, 3, 4]) == {}


def test_access_time_refreshes_on_insert() -> None:
    tree = RadixTree(Clock())
    tree.insert([1, 1], A)
    tree.insert([2, 2], A)
    tree.insert([1, 1], A)  # [1, 1] is now newer
    tree.evict(2)
    assert tree.match([1, 1]) == {A: 2} and tree.match([2, 2]) == {}
