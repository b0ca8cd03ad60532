"""Whether int4 quantization at load gives back a Q4_1 GGUF file's own 4-bit values.

    python scripts/check_gguf_int4.py FILE.gguf CONVERTED_FOLDER

CONVERTED_FOLDER: the safetensors folder specdec made from FILE (for the built-in SmolLM2:
~/.cache/specdec/smollm2-135m-instruct). For each Q4_1 projection whose rows GGUF keeps in the model's
order (all but attention q and k, which llama.cpp's converter permutes), packs the file's own 4-bit
values, scales and minima for torch's int4 kernel, and compares them bit for bit with what
`runtime.weights: int4` makes from the converted float weights.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from safetensors.torch import load_file

from specdec_cli.loading import quantized

NAMES = {
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_output": "self_attn.o_proj",
    "attn_v": "self_attn.v_proj",
}
BLOCK = 20  # bytes of a Q4_1 block: fp16 scale d, fp16 minimum m, 16 bytes of 32 nibbles


def main() -> None:
    reader = GGUFReader(sys.argv[1])
    weights = {}
    for file in Path(sys.argv[2]).glob("*.safetensors"):
        weights.update(load_file(file))
    same = total = 0
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if tensor.tensor_type.name != "Q4_1" or parts[2] not in NAMES:
            continue
        raw = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, BLOCK)
        d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        nibbles = torch.from_numpy(raw[..., 4:].astype(np.int32))
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).flatten(1)  # element j: low nibble j, j + 16: high
        converted = weights[f"model.layers.{parts[1]}.{NAMES[parts[2]]}.weight"].float()
        mine, the_files = quantized.quantize(converted, "int4"), quantized.int4_from_groups(q, d, m + 8 * d)
        same += torch.equal(mine.data, the_files.data) and torch.equal(mine.scales, the_files.scales)
        total += 1
    print(f"{same}/{total} Q4_1 tensors: the same 4-bit values, scales and zeros")


if __name__ == "__main__":
    main()
