"""An approximate prefix tree of what each instance has cached, built from the router's own dispatches.

A compressed radix tree over int sequences (token ids, or UTF-8 bytes of text), as SGLang's and SMG's
cache_aware trees: every node records which instances hold the prefix ending at it and when each last used
it. Holding is prefix-closed (an instance holding a node holds all its ancestors), so `match` is one walk
down the tree. Work per call is per edge, not per token: keys are packed into bytes (4 per token id, 1 per
text byte) once, and edges are compared as byte slices (memcmp), which also keeps a token at 4 bytes of memory.
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from collections.abc import Callable, Iterator, Sequence

from psrl.router.registry import InstanceId

TOKEN_WIDTH = 4  # bytes per packed token id (uint32)


def encode_key(seq: Sequence[int]) -> tuple[bytes, int]:
    """(packed key, bytes per element): text bytes stay as they are; token ids become uint32s."""
    if isinstance(seq, bytes | bytearray | memoryview):
        return bytes(seq), 1
    return array("I", seq).tobytes(), TOKEN_WIDTH


def common_prefix_len(edge: bytes, key: bytes, start: int, width: int = 1) -> int:
    """Bytes in the common prefix of `edge` and `key[start:]`, in whole elements of `width` bytes, found by a
    binary search over slice comparisons."""
    hi = min(len(edge), len(key) - start) // width
    if edge[: hi * width] == key[start : start + hi * width]:
        return hi * width
    lo = 0  # lo elements match, hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[lo * width : mid * width] == key[start + lo * width : start + mid * width]:
            lo = mid
        else:
            hi = mid
    return lo * width


class _Node:
    __slots__ = ("children", "edge", "holders", "parent")

    def __init__(self, edge: bytes, parent: _Node | None) -> None:
        self.edge = edge  # packed elements
        self.parent = parent
        self.children: dict[bytes, _Node] = {}  # keyed by the child's first packed element
        self.holders: dict[InstanceId, float] = {}  # instance -> last access time


class RadixTree:
    """Which instances hold which prefixes, with a per-instance size in elements and LRU eviction.

    A tree holds one kind of key: token ids, or bytes of text (its first insert decides); lengths in and out
    are in elements, not packed bytes.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._root = _Node(b"", None)
        self._width = 0  # bytes per element; 0 until the first insert
        self._sizes: dict[InstanceId, int] = {}  # instance -> packed bytes held

    def _encode(self, key: Sequence[int]) -> bytes:
        packed, width = encode_key(key)
        if width != self._width:
            if self._width:
                raise ValueError("a RadixTree holds token ids or text bytes, not both")
            self._width = width
        return packed

    def insert(self, key: Sequence[int], instance_id: InstanceId, now: float | None = None) -> None:
        """Record that `instance_id` now caches `key` (and so every prefix of it); refreshes access times."""
        k = self._encode(key)
        w = self._width
        n = len(k)
        ts = self._clock() if now is None else now
        node = self._root
        pos = 0
        added = 0
        while pos < n:
            first = k[pos : pos + w]
            child = node.children.get(first)
            if child is None:
                leaf = _Node(k[pos:], node)
                leaf.holders[instance_id] = ts
                node.children[first] = leaf
                added += n - pos
                break
            edge = child.edge
            length = len(edge)
            if k[pos : pos + length] != edge:
                length = common_prefix_len(edge, k, pos, w)
                child = self._split(child, length)
            if instance_id not in child.holders:
                added += length
            child.holders[instance_id] = ts
            pos += length
            node = child
        if added:
            self._sizes[instance_id] = self._sizes.get(instance_id, 0) + added

    def match(self, key: Sequence[int]) -> dict[InstanceId, int]:
        """Matched prefix length (elements) per instance holding at least the first element of `key`."""
        w = self._width
        if not w:
            return {}
        k, width = encode_key(key)
        if width != w:
            return {}
        n = len(k)
        result: dict[InstanceId, int] = {}
        node = self._root
        pos = 0
        while pos < n:
            child = node.children.get(k[pos : pos + w])
            if child is None:
                break
            edge = child.edge
            length = len(edge)
            if k[pos : pos + length] == edge:
                pos += length
                # Holders shrink down the path, so deeper nodes overwrite with longer matches.
                result.update(dict.fromkeys(child.holders, pos // w))
                node = child
                continue
            result.update(dict.fromkeys(child.holders, (pos + common_prefix_len(edge, k, pos, w)) // w))
            break
        return result

    def size_of(self, instance_id: InstanceId) -> int:
        """Elements (tokens, or text bytes) the instance holds in this tree."""
        return self._sizes.get(instance_id, 0) // (self._width or 1)

    def instances(self) -> list[InstanceId]:
        return list(self._sizes)

    def remove_instance(self, instance_id: InstanceId) -> None:
        """Forget an instance everywhere; nodes nobody holds any more are dropped."""
        if self._sizes.pop(instance_id, None) is None:
            return
        self._remove_where(lambda iid: iid == instance_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget every instance (dp rank) of a worker."""
        gone = [iid for iid in self._sizes if iid.base_worker_id == worker_id]
        for iid in gone:
            del self._sizes[iid]
        if gone:
            doomed = set(gone)
            self._remove_where(doomed.__contains__)

    def evict(self, max_size: int) -> None:
        """For every instance holding more than `max_size` elements, drop its least recently used leaves until
        it holds at most `max_size`."""
        max_bytes = max_size * (self._width or 1)
        over = {iid for iid, size in self._sizes.items() if size > max_bytes}
        if not over:
            return
        # Leaves of an instance: nodes it holds where none of the children is held by it.
        heaps: dict[InstanceId, list[tuple[float, int, _Node]]] = {iid: [] for iid in over}
        tie = itertools.count()
        for node in self._nodes():
            for iid in over.intersection(node.holders):
                if not any(iid in c.holders for c in node.children.values()):
                    heaps[iid].append((node.holders[iid], next(tie), node))
        for iid, heap in heaps.items():
            heapq.heapify(heap)
            size = self._sizes[iid]
            while size > max_bytes and heap:
                _, _, node = heapq.heappop(heap)
                del node.holders[iid]
                size -= len(node.edge)
                parent = node.parent
                if not node.holders and parent is not None:
                    del parent.children[node.edge[: self._width]]
                if (
                    parent is not None
                    and parent is not self._root
                    and not any(iid in c.holders for c in parent.children.values())
                ):
                    heapq.heappush(heap, (parent.holders[iid], next(tie), parent))
            if size > 0:
                self._sizes[iid] = size
            else:
                del self._sizes[iid]

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge at byte `at` (0 < at < len, on an element boundary): a new parent takes the head
        and a copy of the holders."""
        parent = node.parent
        assert parent is not None
        head = _Node(node.edge[:at], parent)
        head.holders = dict(node.holders)
        node.edge = node.edge[at:]
        node.parent = head
        w = self._width
        head.children[node.edge[:w]] = node
        parent.children[head.edge[:w]] = head
        return head

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _remove_where(self, gone: Callable[[InstanceId], bool]) -> None:
        stack = [self._root]
        while stack:
            node = stack.pop()
            for first, child in list(node.children.items()):
                for iid in [i for i in child.holders if gone(i)]:
                    del child.holders[iid]
                if child.holders:
                    stack.append(child)
                else:  # prefix-closed: nobody holds anything below either
                    del node.children[first]
