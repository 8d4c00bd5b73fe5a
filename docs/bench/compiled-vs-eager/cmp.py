import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
for i, (x, y) in enumerate(zip(a, b)):
    d = [abs(p - q) for p, q in zip(x["plp"], y["plp"]) if p is not None]
    same = next((j for j, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t), None)
    n = same if same is not None else len(x["tokens"])
    dg = [abs(p - q) for p, q in zip(x["lp"][:n], y["lp"][:n])]
    print(f"prompt {i}: prompt-logprob max {max(d):.4f} mean {sum(d)/len(d):.4f}; generated same up to {same}; "
          f"gen lp max {max(dg) if dg else 0:.4f}")
