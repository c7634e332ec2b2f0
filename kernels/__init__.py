"""Op implementations behind one interface: `dataflow.kernels.reference` (NumPy, the definitions of truth)
and `dataflow.kernels.cuda` (CuPy RawKernels, cuBLAS, cuDNN). Imports nothing of ours: shapes arrive as
plain ints and arrays.

Shape legend used by every docstring:
    T  tokens in the chunk (queries)      S  tokens of key/value context (S >= T)
    D  model_dim                          H  query heads     K  kv heads     E  head_dim
    F  ffn_dim                            V  vocab_size
Dtypes: storage is bf16 (ml_dtypes.bfloat16) or float64 for gradient checks; arithmetic is fp32
for bf16 inputs and float64 for float64 inputs ("acc dtype").
"""
