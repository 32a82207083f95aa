import torch, torch.nn.functional as F, itertools
torch.set_num_threads(2)
torch.manual_seed(0)
shapes=[(896,896,True),(896,128,True),(896,4864,False),(4864,896,False),(896,151936,False),(576,576,False),(576,192,False),(576,1536,False),(1536,576,False),(64,64,False),(64,32,True)]
for dt in (torch.bfloat16, torch.float32):
    bad=[]
    for K,N,bias in shapes:
        w=torch.randn(N,K,dtype=dt); b=torch.randn(N,dtype=dt) if bias else None
        for hint in (64,16):
            wp=torch.ops.mkldnn._reorder_linear_weight(w, hint) if dt==torch.bfloat16 else torch.ops.mkldnn._reorder_linear_weight(w, hint)
            for M in [1,2,3,4,5,7,8,9,15,16,17,31,32,33,63,64] if N<100000 else [1,2,16,64]:
                x=torch.randn(M,K,dtype=dt)
                with torch.inference_mode():
                    y=torch.ops.mkldnn._linear_pointwise(x,wp,b,"none",[],"")
                    r=F.linear(x,w,b)
                    x3=x.reshape(1,M,K)
                    y3=torch.ops.mkldnn._linear_pointwise(x3,wp,b,"none",[],"")
                if not torch.equal(y,r) or not torch.equal(y3.reshape(M,N),r): bad.append((K,N,bias,hint,M, (y.float()-r.float()).abs().max().item()))
    print(dt, "mismatches", len(bad), bad[:12])
