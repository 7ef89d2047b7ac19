"""python -m flash_ext: print what this install of flash_ext is and can do."""
import torch

import flash_ext

for key, value in flash_ext.info().items():
    print(f"{key:12s} {value}")
for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.empty(1, 1, 1, 128, device=device, dtype=dtype)
    print(f"{'path/' + device:12s} {flash_ext.kernel_path(q)}")
