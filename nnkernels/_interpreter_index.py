"""A scalar of Triton 3.6's interpreter used as an index (`range(tl.program_id(1), n, SPLIT)`): that interpreter
converts the one-element array it holds with `int()`, which numpy refuses for arrays of one dimension; Triton 3.7
and later take the element out first. Where the interpreter is 3.6's, its patch of `tl.tensor.__index__` is
replaced by the later one (a no-op on later Tritons, whose patch already does this)."""
from triton.runtime import interpreter

_patch_lang_tensor = interpreter._patch_lang_tensor


def _index(self):
    return int(self.handle.data.squeeze())


def _patch_with_scalar_index(tensor, scope):
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", _index)


interpreter._patch_lang_tensor = _patch_with_scalar_index
