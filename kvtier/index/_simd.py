"""LLVM intrinsics the numba code cannot express: a 16-token vector compare and a prefetch.

``diff16(tokens, x, j, q, s)``: the 16-bit mask (as an int64) of the ``i < 16`` with
``zext(tokens[x, j + i]) != ext(q[s + i])``, so 0 exactly when the 16 stored tokens equal the 16 query
ids (a vector ``icmp ne`` into an AVX-512 mask register). The stored tokens are uint32 (zero-extended); query ids
are int64, int32 (sign-extended) or uint32 (zero-extended). A caller's id in [2**31, 2**32) can equal a stored code
(page_trie.py: wide ids): the matcher then checks the whole query, not only its unmatched tail (``M_WIDE``).
Compiled to vector loads, compares/xors and a mask test (numba's scalar loop becomes a chain of 16
compare-and-branch pairs). No bounds checks: callers guarantee ``j + 16 <= tokens.shape[1]`` and
``s + 16 <= len(q)``.

``prefetch(arr, i)``: hint the CPU to load the cache line holding ``arr[i]`` (1-D) or ``arr[i, 0]``
(2-D). Any address is safe for a prefetch, so ``i`` may lie outside the array.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["diff16", "prefetch"]

_I64 = ir.IntType(64)


def _item_ptr(context, builder, aty, aval, inds):
    a = context.make_array(aty)(context, builder, aval)
    return cgutils.get_item_pointer2(context, builder, data=a.data, shape=cgutils.unpack_tuple(builder, a.shape),
                                     strides=cgutils.unpack_tuple(builder, a.strides), layout=aty.layout,
                                     inds=inds, wraparound=False)


def _load16(builder, ptr, dtype):
    w = dtype.bitwidth
    v = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(w), 16).as_pointer()), align=w // 8)
    if w < 64:
        v16 = ir.VectorType(_I64, 16)
        v = builder.sext(v, v16) if dtype.signed else builder.zext(v, v16)
    return v


@intrinsic
def diff16(typingctx, tokens, x, j, q, s):
    if not (isinstance(tokens, types.Buffer) and tokens.ndim == 2 and isinstance(q, types.Buffer) and q.ndim == 1):
        return None
    sig = types.int64(tokens, x, j, q, s)

    def codegen(context, builder, signature, args):
        tt, xt, jt, qt, st = signature.args
        tv, xv, jv, qv, sv = args
        xv = context.cast(builder, xv, xt, types.intp)
        jv = context.cast(builder, jv, jt, types.intp)
        sv = context.cast(builder, sv, st, types.intp)
        tvec = _load16(builder, _item_ptr(context, builder, tt, tv, [xv, jv]), tt.dtype)
        qvec = _load16(builder, _item_ptr(context, builder, qt, qv, [sv]), qt.dtype)
        ne = builder.icmp_unsigned("!=", tvec, qvec)  # <16 x i1>: AVX-512 compares into mask registers
        return builder.zext(builder.bitcast(ne, ir.IntType(16)), _I64)

    return sig, codegen


@intrinsic
def prefetch(typingctx, arr, i):
    if not (isinstance(arr, types.Buffer) and arr.ndim in (1, 2)):
        return None
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):
        at, it = signature.args
        av, iv = args
        a = context.make_array(at)(context, builder, av)
        iv = context.cast(builder, iv, it, types.intp)
        stride = cgutils.unpack_tuple(builder, a.strides)[0]
        addr = builder.add(builder.ptrtoint(a.data, _I64), builder.mul(iv, stride))
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.inttoptr(addr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
