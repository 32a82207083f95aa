import time, torch, torch.nn.functional as F
torch.set_num_threads(2)
def bench(f, n=20):
    for _ in range(3): f()
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return 1000*ts[n//2]
dt=torch.bfloat16
print(torch.backends.mkldnn.is_available(), torch.__version__)
for (M,K,N) in ((64,896,4864),(64,4864,896),(64,896,1152),(64,896,151936),(16,896,4864)):
    x=torch.randn(M,K,dtype=dt); w=torch.randn(N,K,dtype=dt)
    with torch.inference_mode():
        a=bench(lambda: F.linear(x,w))
        r=[f"{M}x{K}x{N} linear {a:.3f}ms {2*M*K*N/a/1e6:.1f}GF/s"]
        try:
            wp=torch.ops.mkldnn._reorder_linear_weight(w, M)
            y=torch.ops.mkldnn._linear_pointwise(x,wp,None,"none",[],"")
            b=bench(lambda: torch.ops.mkldnn._linear_pointwise(x,wp,None,"none",[],""))
            r.append(f"packed {b:.3f}ms {2*M*K*N/b/1e6:.1f}GF/s same={torch.equal(y,F.linear(x,w))} maxdiff={(y.float()-F.linear(x,w).float()).abs().max().item():.4g}")
        except Exception as e:
            r.append("packed fail "+repr(e)[:300])
    print(*r)
