import time, torch, torch.nn.functional as F
torch.set_num_threads(2)
def bench(f, n=40):
    for _ in range(5): f()
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return 1000*ts[n//2]
dt=torch.bfloat16
for name, d, dq, dkv, ff in (("smollm2", 576, 576, 192, 1536), ("qwen0.5b", 896, 896, 128, 4864)):
  wq, wk, wv = (torch.randn(n, d, dtype=dt)*0.05 for n in (dq, dkv, dkv))
  wg, wu = (torch.randn(ff, d, dtype=dt)*0.05 for _ in range(2))
  wqkv = torch.cat([wq, wk, wv]); wgu = torch.cat([wg, wu])
  for S in (1, 16, 64):
    x = torch.randn(S, d, dtype=dt)
    with torch.inference_mode():
      a = bench(lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)))
      b = bench(lambda: F.linear(x, wqkv).split([dq, dkv, dkv], -1))
      c = bench(lambda: (F.linear(x, wg), F.linear(x, wu)))
      e = bench(lambda: F.linear(x, wgu).split([ff, ff], -1))
      same1 = all(torch.equal(p, q_) for p, q_ in zip((F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)), F.linear(x, wqkv).split([dq, dkv, dkv], -1)))
      same2 = all(torch.equal(p, q_) for p, q_ in zip((F.linear(x, wg), F.linear(x, wu)), F.linear(x, wgu).split([ff, ff], -1)))
    print(name, S, f"qkv {a:.3f}->{b:.3f}  gu {c:.3f}->{e:.3f} ms  bitwise {same1} {same2}")
