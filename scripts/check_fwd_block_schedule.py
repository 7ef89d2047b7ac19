"""Exhaustive check, in Python, of the forward kernel's key-block schedule (csrc/sm80/fwd_kernel.cuh): every
block of the band visited once, unmasked blocks fully visible to every row, prefetch order consistent, and
a warp that skips a masked block (BandMask::misses) sees none of its keys.
Mirrors the kernel's arithmetic; run it after changing the schedule: python3 scripts/check_fwd_block_schedule.py"""
import itertools
UNB = 1 << 40
def band(len_q, len_k, left, right):
    L = UNB if left == -1 else left; R = UNB if right == -1 else right; off = len_k - len_q
    def begin(row): return max(0, min(len_k, row + off - L))
    def end(row): return max(0, min(len_k, row + off + R + 1))
    return begin, end
def misses(len_q, len_k, left, right, first_row, last_row, first_key, last_key):
    """BandMask::misses, with int32 caps as in the kernel."""
    off = len_k - len_q
    left32 = min(UNB if left == -1 else left, 1 << 30); right32 = min(UNB if right == -1 else right, 1 << 30)
    return first_key - last_row - off > right32 or last_key - first_row - off < -left32
def check(len_q, len_k, left, right, M, N, rows_per_warp=32):
    begin, end = band(len_q, len_k, left, right)
    for first_row in range(0, len_q, M):
        valid_rows = min(M, len_q - first_row)
        key_begin = begin(first_row); key_end = end(first_row + valid_rows - 1)
        first_key_block = key_begin // N
        num_key_blocks = (key_end + N - 1) // N if key_end > key_begin else 0
        if num_key_blocks == 0:
            # every row sees nothing
            assert all(end(r) <= begin(r) for r in range(first_row, first_row + valid_rows)), (len_q, len_k, left, right, first_row)
            continue
        last_row = first_row + valid_rows - 1
        hi = max(first_key_block, min(num_key_blocks, end(first_row) // N))
        lo = min(hi, max(first_key_block, (begin(last_row) + N - 1) // N))
        n_right = num_key_blocks - hi
        n_masked = n_right + (lo - first_key_block)
        n_blocks = num_key_blocks - first_key_block
        def sched(i):
            if i >= n_blocks: return -1
            if i < n_right: return hi + i
            if i < n_masked: return lo - 1 - (i - n_right)
            return hi - 1 - (i - n_masked)
        # kernel loop emulation
        visits = []
        kb = sched(0); nxt = sched(1)
        visits.append((kb, n_masked > 0, nxt))
        i = 1
        while i < n_masked:
            kb = nxt; nxt = sched(i + 1); visits.append((kb, True, nxt)); i += 1
        while i < n_blocks:
            kb = nxt; nxt = kb - 1 if i + 1 < n_blocks else -1; visits.append((kb, False, nxt)); i += 1
        blocks = [v[0] for v in visits]
        assert sorted(blocks) == list(range(first_key_block, num_key_blocks)), (blocks, first_key_block, num_key_blocks)
        for j, (kb, masked, nxt) in enumerate(visits):
            assert nxt == (visits[j + 1][0] if j + 1 < len(visits) else -1)
            if not masked:  # every row of the block sees every key of the block
                for r in range(first_row, first_row + valid_rows):
                    assert begin(r) <= kb * N and (kb + 1) * N <= end(r), (len_q, len_k, left, right, first_row, kb)
            else:  # a warp skipping the block sees none of its keys
                for w in range(0, M, rows_per_warp):
                    if misses(len_q, len_k, left, right, first_row + w, first_row + w + rows_per_warp - 1, kb * N, kb * N + N - 1):
                        for r in range(first_row + w, min(first_row + w + rows_per_warp, first_row + valid_rows)):
                            assert not (begin(r) < min(end(r), (kb + 1) * N) and end(r) > max(begin(r), kb * N)), (len_q, len_k, left, right, r, kb)
        # every visible key lies in a visited block
        for r in range(first_row, first_row + valid_rows):
            if end(r) > begin(r):
                assert begin(r) // N >= first_key_block and (end(r) - 1) // N < num_key_blocks
n = 0
for len_q, len_k in itertools.product([1, 17, 64, 127, 128, 129, 200, 300], [1, 17, 63, 64, 65, 200, 257, 300]):
    for left, right in itertools.product([-1, 0, 1, 63, 64, 65, 127, 200], [-1, 0, 1, 63, 64, 65, 130]):
        for M, N, rows_per_warp in ((128, 64, 32), (64, 64, 16)):
            check(len_q, len_k, left, right, M, N, rows_per_warp); n += 1
print("ok", n, "configurations")
