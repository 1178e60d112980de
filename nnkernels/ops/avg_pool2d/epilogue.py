"""The store the plane-major pooling kernels (`gather.py`, `lanes.py`) end with: a tile of fp32 results written
as rows of the output, in vector stores where ROW_ALIGN allows."""
import triton
import triton.language as tl


@triton.jit
def columns_in(cols, row_length, ROW_ALIGN: tl.constexpr):
    """Which of the columns `cols` are < row_length (a multiple of ROW_ALIGN), compared a ROW_ALIGN group at a
    time: the mask is then constant over each aligned group, which lets its loads and stores be vectors."""
    return (cols // ROW_ALIGN) < (row_length // ROW_ALIGN)


@triton.jit
def store_rows(out, rows, cols, row_length, values, row_in, ROW_ALIGN: tl.constexpr):
    """out[rows, cols] = values ([R, C], cast to out's element type) of a row-major matrix of rows row_length
    long, where row_in [R] and `columns_in`. Row starts are multiples of ROW_ALIGN (a power of two dividing
    row_length), as the compiler is told."""
    out_row = out + tl.multiple_of(rows.to(tl.int64) * row_length, ROW_ALIGN)
    col_in = columns_in(cols, row_length, ROW_ALIGN)
    tl.store(out_row[:, None] + cols[None, :], values.to(out.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])
