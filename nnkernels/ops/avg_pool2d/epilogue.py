"""The store the plane-major pooling kernels (`gather.py`, `lanes.py`) end with: a tile of fp32 results written
as rows of the output, in vector stores where ROW_ALIGN allows."""
import triton
import triton.language as tl

from ..common.tiles import columns_in


@triton.jit
def store_rows(out, rows, cols, row_length, values, row_in, ROW_ALIGN: tl.constexpr):
    """out[rows, cols] = values ([R, C], cast to out's element type) of a row-major matrix of rows row_length
    long, where row_in [R] and `columns_in`. Row starts are multiples of ROW_ALIGN (a power of two dividing
    row_length), as the compiler is told."""
    out_row = out + tl.multiple_of(rows.to(tl.int64) * row_length, ROW_ALIGN)
    col_in = columns_in(cols, row_length, ROW_ALIGN)
    tl.store(out_row[:, None] + cols[None, :], values.to(out.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])
