import time, torch, torch.nn.functional as F
torch.set_num_threads(2)
def bench(f, n=40):
    for _ in range(5): f()
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return 1000*ts[n//2]
for S in (16, 64):
    T, Hk, g, D = 384, 3, 3, 64
    dt = torch.bfloat16
    q = torch.randn(S, Hk, g, D, dtype=dt); k = torch.randn(S, Hk, T, D, dtype=dt); v = torch.randn(S, Hk, T, D, dtype=dt)
    valid = torch.arange(T)[None] < torch.randint(200, T, (S,))[:, None]
    mask = torch.zeros(S,1,1,T,dtype=dt).masked_fill_(~valid[:,None,None,:], torch.finfo(dt).min)
    with torch.inference_mode():
        a = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5))
        def mm():
            s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(D**-0.5).add_(mask)
            return torch.matmul(s.softmax(-1).to(dt), v)
        c = bench(mm)
        def mmf():
            s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(D**-0.5).add_(mask)
            return torch.matmul(s.softmax(-1), v.float()).to(dt)
        d = bench(mmf)
        def mmh():  # scores fp32 via k fp32, pv in bf16
            s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(D**-0.5).add_(mask)
            return torch.matmul(s.softmax(-1).to(dt), v)
        e = bench(mmh)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=D**-0.5)
        errs = [(x().double()-ref).abs().max().item() for x in (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5), mm, mmf, mmh)]
    print(S, f"sdpa {a:.3f} mm-bf16 {c:.3f} mm-f32 {d:.3f} mm-half {e:.3f} ms  errs", ["%.4f" % x for x in errs])
