#!/usr/bin/env python3
# Host check of decode/format_fp8.cuh's per-lane fragment formulas (k_frag, k_scales, v_frag),
# transcribed here: the B matrices the 32 lanes form must be K^T / V tiles in the PTX
# mma.m16n8k16 fragment layout (b0 = B[2tq][g], B[2tq+1][g]; b1 = rows + 8; C cols 2tq, 2tq+1)
# for every warp, k16 step and PV chunk of the 4- and 8-warp splits. Prints OK or the mismatches.
# usage: python3 scripts/fp8-frag-check.py  (re-transcribe the formulas when they change)
# Emulates RowFp8::k_frag / v_frag / k_scales lane formulas (as written in format_fp8.cuh) and
# checks the B matrices they form against the PTX m16n8k16 fragment layout.
import random
R=656  # ds_mla staged row bytes
rows=32
# stage: K[r][d] symbolic = (r, d); represent bytes by (row, byte) tuples
def k_frag(krow, kk, lane):
    g, tq = lane>>2, lane&3
    col = kk*16 + 2*tq
    row0 = (krow & ~15) + g
    out=[]
    for i in range(4):
        rb = row0 + (i>>1)*8
        c = col + 8*(i&1)
        if kk*16 < 512:
            out.append(((rb,c),(rb,c+1), ('scale', rb, c>>7)))
        else:
            out.append(((rb,c),(rb,c+1), None))
    return out
def k_scales(krow, kk, lane):
    tq = lane&3
    base = (krow & ~15) + 2*tq
    return [[(base+8*n+e, kk>>3) for e in range(2)] for n in range(2)]
def v_frag(vrow, dchunk, lane):
    g, tq = lane>>2, lane&3
    d = (dchunk & ~1)*8 + g
    r0 = (vrow & ~15) + 2*tq
    b=[None]*4
    for h in range(2):
        ra = r0 + h*8; rb = ra+1
        b[h] = ((ra,d),(rb,d), (d>>7))
        b[2+h] = ((ra,d+8),(rb,d+8), ((d+8)>>7))
    return b
ok=True
# S: warp nh in 0..1, kk any; lane's krow = nh*16 + (mat>>1)*8 + mrow, col_half = mat&1
for nh in range(2):
  for kk in range(36):
    B=[{},{}]  # n-tile -> {(k,n): element}
    for lane in range(32):
        mat, mrow = lane>>3, lane&7
        krow = nh*16 + (mat>>1)*8 + mrow
        fr = k_frag(krow, kk, lane)
        g,tq = lane>>2, lane&3
        for nt in range(2):
            b0, b1 = fr[2*nt], fr[2*nt+1]
            # PTX: b0 = B[2tq][g], B[2tq+1][g]; b1 = B[2tq+8][g], B[2tq+9][g]
            for (reg, kbase) in ((b0,2*tq),(b1,2*tq+8)):
                B[nt][(kbase, g)] = reg[0]; B[nt][(kbase+1, g)] = reg[1]
        # check: B_nt[k][n] must be K[nh*16 + 8nt + n][kk*16 + k]
        sc = k_scales(krow, kk, lane)
        for nt in range(2):
            for e in range(2):
                if sc[nt][e] != (nh*16+8*nt+2*tq+e, kk>>3): ok=False; print('scale',nh,kk,lane,nt,e,sc[nt][e])
    for nt in range(2):
        for k in range(16):
            for n in range(8):
                if B[nt][(k,n)] != (nh*16+8*nt+n, kk*16+k): ok=False; print('K', nh, kk, nt, k, n, B[nt][(k,n)])
# PV: warps w, kODims 128 (4 warps) or 64 (8 warps)
for kOD in (128,64):
  for w in range(512//kOD):
    for kk in range(2):
      for pr in range(kOD//16):
        B=[{},{}]
        for lane in range(32):
            mat, mrow = lane>>3, lane&7
            vrow = kk*16 + (mat&1)*8 + mrow
            dchunk = (w*kOD + pr*16)//8 + (mat>>1)
            fr = v_frag(vrow, dchunk, lane)
            g,tq = lane>>2, lane&3
            for nt in range(2):
                b0, b1 = fr[2*nt], fr[2*nt+1]
                for (reg,kbase) in ((b0,2*tq),(b1,2*tq+8)):
                    B[nt][(kbase,g)] = reg[0]; B[nt][(kbase+1,g)] = reg[1]
                    # scale tile must be that of the dim
                    if reg[2] != reg[0][1]>>7: ok=False
        d0 = w*kOD + pr*16
        for nt in range(2):
            for k in range(16):
                for n in range(8):
                    if B[nt][(k,n)] != (kk*16+k, d0+8*nt+n): ok=False; print('V',kOD,w,kk,pr,nt,k,n,B[nt][(k,n)])
print('OK' if ok else 'MISMATCH')
