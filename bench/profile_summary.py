#!/usr/bin/env python3
"""Self time per operator of a Chrome trace from `dew bench --one MODEL --profile FILE` or
`bench/peer.py ... --profile FILE`, in ms per step, largest first.

usage: bench/profile_summary.py TRACE.json --steps 20 [--top 25] [--group conv=convolution,mkldnn_convolution]

The self time of an event is its duration less that of the events nested directly inside it on the same
thread, so the rows add up to the operator time of the trace without counting a parent and its children
twice. --group adds a line per named group: the summed self time of every operator whose name contains
one of the group's comma-separated words, and its share of the total.
"""
import argparse
import collections
import json
import sys


def self_times(events):
    """{name: (self microseconds, count)} over the complete ('X') events, per thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    total = collections.Counter()
    count = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        own = {}
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            own[id(e)] = e["dur"]
            if stack:
                own[id(stack[-1])] -= e["dur"]
            stack.append(e)
        for e in evs:
            total[e["name"]] += own[id(e)]
            count[e["name"]] += 1
    return total, count


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, required=True, help="steps the trace covers (the timed steps)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--group", action="append", default=[], help="NAME=word1,word2 (substring match)")
    a = ap.parse_args()
    if a.steps < 1:
        sys.exit("profile_summary: --steps must be >= 1")
    with open(a.trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    total, count = self_times(events)
    grand = sum(total.values())
    if grand <= 0:
        sys.exit(f"profile_summary: {a.trace} has no complete events")
    per = 1e3 * a.steps
    print(f"{'ms/step':>9} {'share':>6} {'calls/step':>10}  operator")
    for name, us in total.most_common(a.top):
        print(f"{us / per:9.2f} {100 * us / grand:5.1f}% {count[name] / a.steps:10.1f}  {name}")
    print(f"{grand / per:9.2f} 100.0% {'':>10}  all operators")
    for g in a.group:
        name, _, words = g.partition("=")
        keys = [w for w in words.split(",") if w]
        us = sum(v for k, v in total.items() if any(w in k for w in keys))
        print(f"{us / per:9.2f} {100 * us / grand:5.1f}% {'':>10}  group {name} ({', '.join(keys)})")


if __name__ == "__main__":
    main()
