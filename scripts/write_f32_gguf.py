"""A float32 GGUF file with a quantized GGUF's values: the same metadata and tokenizer, every tensor
dequantized, so llama.cpp decodes exactly the weights specdec decodes in float32 from the quantized
file (specdec dequantizes it the same way).

    python scripts/write_f32_gguf.py IN.gguf OUT.gguf
"""

import sys

import gguf
import numpy as np
from gguf.constants import GGUFValueType


def main(source: str, out: str) -> None:
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(out, bytes(arch.parts[arch.data[0]]).decode())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # the writer writes these itself
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            values = [field.contents(i) for i in range(len(field.data))]
            writer.add_array(name, values)
        else:
            writer.add_key_value(name, field.contents(), kind)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(d) for d in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
