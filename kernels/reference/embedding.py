"""Token embedding: a gather forward, a scatter-add backward."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype


def embedding_fwd(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """ids (T,) int; table (V, D) -> x (T, D) in table's dtype (a pure gather, exact)."""
    return table[np.asarray(ids)]


def embedding_bwd(ids: np.ndarray, dx: np.ndarray, vocab_size: int) -> np.ndarray:
    """ids (T,) int; dx (T, D) -> dtable (V, D) in the acc dtype, rows summed per id."""
    dt = acc_dtype(dx)
    dtable = np.zeros((vocab_size, dx.shape[1]), dtype=dt)
    np.add.at(dtable, np.asarray(ids), dx.astype(dt))
    return dtable
