import torch, time
x = torch.randn(4096, 4096, device="cuda")
ev = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(3)]
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    y = x @ x
torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        ev[0].record(); y = x @ x; ev[1].record(); z = y @ y; z = z @ z; ev[2].record()
    for i in range(3):
        g.replay(); torch.cuda.synchronize()
        print("replay", i, "ms", round(ev[0].elapsed_time(ev[1]), 4), round(ev[1].elapsed_time(ev[2]), 4))
    g.replay(); g.replay(); print("queried while pending:", ev[2].query()); torch.cuda.synchronize()
    print("after two replays", round(ev[0].elapsed_time(ev[1]), 4))
except Exception as e:
    print("FAILED", type(e).__name__, str(e)[:300])
