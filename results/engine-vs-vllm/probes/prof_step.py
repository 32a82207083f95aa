import sys, time, torch
from retention.models import load_model
from retention.runs.bench import _EngineStepper
S = int(sys.argv[1]); model = sys.argv[2] if len(sys.argv) > 2 else "smollm2-135m"
torch.set_num_threads(2)
loaded = load_model(model, "bfloat16")
prompt = list(range(1000, 1256))
st = _EngineStepper(loaded, prompt, "full", None, None, "mean", {}, S, 128)
with torch.inference_mode():
    st.prefill()
    for _ in range(20): st.step()
    ts = []
    for _ in range(20):
        t = time.perf_counter(); st.step(); ts.append(time.perf_counter() - t)
    ts.sort(); print("median step ms", 1000 * ts[10], "tok/s", S / ts[10])
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(10): st.step()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
