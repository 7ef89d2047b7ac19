"""A model of the handoffs between the persistent sm90 dK/dV kernel's consumers and its producer warp
at named barriers (query buffer g % kStages released after step g; tile slot (r + 1) % 2 full, then free).

Each side runs its program in order (the consumers as one: a consumer warp cannot run a generation ahead of
the others, since its next arrival at a barrier needs data that the producer loads only after the current
generation completed); an arrive posts an event, a sync posts one and waits for the other side's event of
the same generation. Checked for every walk-length sequence: no deadlock, no side arriving twice before a
generation completed (a named barrier would then count 512 arrivals against 288), and every barrier
balanced when both programs end (the producer's drains included).

    python3 scripts/dkdv_handoff_model.py   # "ok N walk sequences"
"""
import itertools, random

def run(steps, S):
    R = len(steps)  # rounds: each writes the next walk's tile (the last one past the end) into a slot
    total = sum(steps)
    before = [sum(steps[:r]) for r in range(len(steps))]
    # Producer program
    prod = []
    for r, n in enumerate(steps):
        for i in range(n):
            g = before[r] + i
            if g >= S: prod.append(('sync', ('QB', g % S)))
            prod.append(('load', g))
        q = r + 1
        if r >= 2: prod.append(('sync', ('FREE', q % 2)))
        prod.append(('arrive', ('FULL', q % 2)))
    for g in range(max(0, total - S), total): prod.append(('sync', ('QB', g % S)))
    for q in range(max(1, R - 1), R + 1): prod.append(('sync', ('FREE', q % 2)))
    # Consumer program: step g needs load g; releases step g (QB arrive) after step g + 1's start or at walk end
    cons = []
    for r, n in enumerate(steps):
        for i in range(n):
            g = before[r] + i
            cons.append(('need', g))
            if i > 0: cons.append(('arrive', ('QB', (g - 1) % S)))
        if n > 0: cons.append(('arrive', ('QB', (before[r] + n - 1) % S)))
        q = r + 1
        cons.append(('sync', ('FULL', q % 2)))
        cons.append(('arrive', ('FREE', q % 2)))
    # Barrier state: per barrier, generation counters per side (events posted), completed generations
    posted = {}  # (barrier, side) -> count of events posted
    loaded = set()
    pc = {'p': 0, 'c': 0}
    progs = {'p': prod, 'c': cons}
    def other(s): return 'c' if s == 'p' else 'p'
    while pc['p'] < len(prod) or pc['c'] < len(cons):
        moved = False
        for side in ('p', 'c'):
            if pc[side] >= len(progs[side]): continue
            op, arg = progs[side][pc[side]]
            if op == 'load':
                loaded.add(arg); pc[side] += 1; moved = True
            elif op == 'need':
                if arg in loaded: pc[side] += 1; moved = True
            elif op in ('arrive', 'sync'):
                mine = posted.get((arg, side), 0)
                theirs = posted.get((arg, other(side)), 0)
                if ('waiting', side) not in posted and mine > theirs:
                    raise AssertionError(f"{side} arrives twice at {arg} before generation {theirs} completed: {steps}")
                if op == 'arrive':
                    posted[(arg, side)] = mine + 1; pc[side] += 1; moved = True
                else:  # sync: post, then wait for the other side's event of this generation
                    if ('waiting', side) not in posted:
                        posted[(arg, side)] = mine + 1; posted[('waiting', side)] = mine + 1
                    gen = posted[('waiting', side)]
                    if posted.get((arg, other(side)), 0) >= gen:
                        del posted[('waiting', side)]; pc[side] += 1; moved = True
        if not moved:
            raise AssertionError(f"deadlock at p={prod[pc['p']] if pc['p'] < len(prod) else 'end'} "
                                 f"c={cons[pc['c']] if pc['c'] < len(cons) else 'end'}: {steps}")
    for (arg, side), n in list(posted.items()):
        if arg == 'waiting': continue
        assert posted.get((arg, other(side)), 0) == n, f"unbalanced {arg}: {steps}"

random.seed(1)
count = 0
for S in (2, 3):
    for length in range(1, 7):
        for steps in itertools.product([0, 1, 2, 3, 5], repeat=length):
            run(list(steps), S); count += 1
    for _ in range(2000):
        run([random.choice([0, 1, 2, 3, 4, 17, 18]) for _ in range(random.randint(1, 20))], S); count += 1
print("ok", count, "walk sequences")
