import torch,time
torch.set_num_threads(2)
def bench(f,n=20):
    for _ in range(3): f()
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return 1000*ts[n//2]
for V in (49152,151936):
    x=torch.randn(64,V).to(torch.bfloat16)
    xf=x.float()
    print(V, "argmax bf16 %.2f"%bench(lambda: x.argmax(-1)), "argmax f32 %.2f"%bench(lambda: xf.argmax(-1)), "to f32+argmax %.2f"%bench(lambda: x.float().argmax(-1)), "max bf16 %.2f"%bench(lambda: x.max(-1)), 
      "view int16 trick n/a")
    assert torch.equal(x.argmax(-1), x.float().argmax(-1))
