"""megarl's rank entry imports megatron-core without torch.compile's machinery (megarl/models/
megatron_import.py): TorchDynamo and Inductor stay unloaded, torch.compile is torch's own again, and
megatron's compiled kernels still compute what they did, compiled at their first call."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = """
import sys, torch
original = torch.compile
from megarl.models.megatron_import import import_megatron
import_megatron()
assert torch.compile is original, "torch.compile left replaced"
loaded = [m for m in ("torch._dynamo", "torch._inductor.compile_fx") if m in sys.modules]
assert not loaded, loaded
from megatron.core.fusions.fused_bias_gelu import bias_gelu
torch.manual_seed(0)
b, y = torch.randn(4), torch.randn(3, 4)
x = b + y
want = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
assert torch.allclose(bias_gelu(b, y), want)
assert "torch._dynamo" in sys.modules, "the kernel's first call did not go through torch.compile"
print("ok")
"""


def test_megatron_loads_without_dynamo_and_its_kernels_compile_on_first_call():
    # TORCHDYNAMO_DISABLE: the first call goes through torch.compile, which then runs the kernel
    # eagerly (Inductor's CPU code generation would need a C++ compiler and half a minute)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT, "TORCHDYNAMO_DISABLE": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-3000:]
