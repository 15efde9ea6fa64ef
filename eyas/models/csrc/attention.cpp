// Attention of the fused int4 layer over its KV cache (float32, float16 or float64), on the CPU.
// The floor it chases: the multiply-adds of q . k and p * v (2 * heads * head_dim per visible
// key and row) at the float32 FMA peak. How: a chunk's keys are transposed once into a tile
// that every query with the same keys there reads, as a register-tiled product (no horizontal
// sums, 8 queries per loaded key vector), and each value row is loaded once for up to 4
// queries (on AVX-512 a float16 chunk that many queries read is widened to float32 once);
// what is left above the FMAs is one transpose per tile, the 16-lane softmax of each 64-key
// chunk and the in-order combine of the chunks. Measured on a prefill chunk of 256 tokens after
// 1,792 cached (SmolLM2, 30 layers, 2 threads, AMD Zen 4; parts timed by leaving each out): the
// score and value FMAs ~180 ms at ~95 G multiply-adds/s of the 117 G float peak, the softmaxes
// ~50 ms (exp16's ~35 operations per 16 lanes), the combine ~40 ms (a double exponential per
// query and chunk, and 20 MB of partials a layer), the work items' bookkeeping ~30 ms.
//
// Two implementations with the same contract (attention.h): `chunked_attention` for a float32
// or float16 cache and head_dim 64 or 128 on AVX2 or AVX-512 (what the engine runs; the same
// bits on both), and `generic_attention` for the rest. Which one runs depends only on the cache's
// dtype, head_dim and the build, never on the pass, so every pass of a process computes a row
// the same way.

#include "attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "phase_timer.h"
#include "simd.h"

namespace eyas {
namespace {

// Scaled dot-product attention in the cache's dtype: q [N, Hq, D], keys/values
// [B, KV, S, D] (the cache; row n reads its sequence's), mask [N, S] or none (all kv_len slots
// visible); out [N, Hq, D] rounded to float32 (the o_proj input).
// Each query's scores, softmax and weighted sum run over its visible slots in increasing order
// with the same instructions whatever T is: a row's output does not depend on the other rows
// of the pass, so a one-token step and a verification pass agree bit for bit.
template <typename T>
void generic_attention(const T* q, const T* keys, const T* values, const Visibility& visible, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out) {
  const bool* mask = visible.mask;
  const int64_t kv_len = visible.kv_len, rows = visible.rows();
  using S = Simd<T>;
  const int64_t group = heads / kv_heads;
  const T scale = T(1.0 / std::sqrt(double(head_dim)));
  const int64_t work = rows * group * kv_len * head_dim;
  // Work items: (row, kv head), so that a long pass (a prefill) spreads over the threads; how
  // queries are grouped changes no value.
  const int64_t items = rows * kv_heads;
  eyas::parallel_for(0, items, work >= (1 << 15) ? 1 : items, [&](int64_t begin, int64_t end) {
    std::vector<T> probs(kv_len);
    std::vector<typename S::Vec> acc(head_dim / S::width);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kvh = item % kv_heads, b = visible.sequences[row];
      const T* kb = keys + (b * kv_heads + kvh) * max_slots * head_dim;
      const T* vb = values + (b * kv_heads + kvh) * max_slots * head_dim;
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {  // the queries of kv head kvh
        const T* qv = q + (row * heads + h) * head_dim;
        const bool* visible = mask ? mask + row * kv_len : nullptr;
        constexpr int block = KeyBlock<T>::size;
        for (int64_t s = 0; s < kv_len; s += block) {
          const int64_t n = std::min<int64_t>(block, kv_len - s);
          if (visible && std::none_of(visible + s, visible + s + n, [](bool v) { return v; })) continue;
          const T* k[block];
          for (int i = 0; i < block; ++i) k[i] = kb + (s + std::min<int64_t>(i, n - 1)) * head_dim;
          T dots[block];
          KeyBlock<T>::scores(qv, k, head_dim, dots);
          for (int64_t i = 0; i < n; ++i) probs[s + i] = dots[i] * scale;
        }
        T best = -INFINITY;
        for (int64_t s = 0; s < kv_len; ++s)
          if (!visible || visible[s]) best = std::max(best, probs[s]);
        for (int64_t s = 0; s < kv_len; ++s)
          probs[s] = (!visible || visible[s]) ? exp_of(probs[s] - best) : T(0);
        T total = 0;
        for (auto& a : acc) a = typename S::Vec{};
        for (int64_t s = 0; s < kv_len; ++s) {
          const T p = probs[s];
          if (p == T(0)) continue;
          total += p;
          const T* vr = vb + s * head_dim;
          for (int64_t c = 0; c < head_dim / S::width; ++c) acc[c] += p * S::load(vr + c * S::width);
        }
        float* o = out + (row * heads + h) * head_dim;
        for (int64_t c = 0; c < head_dim / S::width; ++c)
          for (int64_t i = 0; i < S::width; ++i) o[c * S::width + i] = float(acc[c][i] / total);
      }
    }
  });
}


#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EYAS_CHUNKED_ATTENTION 1

// Attention over a float32 (or float16) cache in chunks of a query's visible keys, for
// head_dim = 16 * NV: what the engine runs.
//
// Chunk j of a query is its visible keys number 64j .. 64j + 63 in slot order. A work item
// (run of rows of one sequence, kv head, chunk j) gathers the keys of the chunk of the run's
// row that sees the most there into a transposed tile (dims x 64 keys, in L1), once; every
// query of the run whose keys in this chunk are the tile's first n (all rows of a prefill
// chunk, every row of a draft tree for the chunks of the cached prefix, the GQA group of one
// token) is scored against it as a small matrix product in registers: lanes across 16 keys, up
// to 8 queries at a time, each query's value broadcast per dim. Queries that fill at most one
// such block (a one-token step's GQA group; a tree node's last chunk, with its own ancestors)
// skip the tile on AVX-512: each 16-key block is transposed in registers as the FMAs consume
// it (a float16 cache's consecutive keys 16 dims at a time, on their 16-bit values; on AVX2
// they get a tile of their own, the shared one's equal leading blocks copied), with the same
// chains. There a pass reads the cache, and its bytes should arrive while the FMAs run: as a
// chunk is read, the rows read next are requested into L2 (prefetcht1, `Ahead`): the query's
// next chunk, or after its last chunk the first chunk of the thread's next work item (the next
// head's or request's keys, which the server's KV pool keeps hundreds of slots away), never
// past a query's keys; a few lines per 16 dims of a key block, one value row per value row
// read (a short last chunk asks for the rest at once). Requesting 64 slots on from every row
// read ~30% more bytes than 16 requests of 200 cached tokens hold and left each head's first
// chunk to the hardware, and a key block's 32 lines requested at once stalled the core (the
// requests fill its miss buffers): with the pool's layout, a 16-request step's attention took
// 1.3-1.4x as long on Zen 4 (`eyas bench profile --sequences 16`, 200 / 400 cached tokens);
// requested into L1 (prefetcht0), slower still.
// The exponentials run 16 lanes at a
// time (exp16), and the weighted sums of value rows run for up to 4 queries per loaded row
// (2 for whole head_dim-128 rows, 4 for their halves where many queries share a chunk; 1 on
// AVX2). Each query keeps a partial softmax (max, sum, weighted sum)
// per chunk, and the partials are combined in chunk order.
//
// Numerics: a score is one chain of FMAs over the dims in order, from zero, in its own lane,
// so its bits do not depend on the tile it sits in, on which queries share it, or on the vector
// width. A query's result depends only on the keys and values it may see, in order, not on the
// slots they sit in (a tree node's slot differs from its slot in sequential decoding), the other
// rows of the pass, how queries are grouped, or kv_len: chunks count visible keys, every chunk's
// softmax runs over a full 64-entry array (padding -inf, then 0) with the same instructions, a
// weighted sum adds its own keys only, and the chunks are combined in order with a scalar exp.
// Floats16 gives the same bits on AVX-512 and AVX2.
constexpr int64_t kChunk = 64;

// One cache line requested into L2. Every loop of requests below counts its trips at compile
// time: gcc deletes a loop whose only statements are __builtin_prefetch calls when it cannot
// (it counts them as having no effect), silently.
inline void request_line(const void* line) { __builtin_prefetch(line, 0, 2); }

// Rows [from, to) of `rows` (to <= kChunk, head_dim HeadDim), requested at once; the loop runs
// kChunk times whatever the range, for the reason above.
template <int64_t HeadDim, typename K>
inline void request_rows(const K* rows, int64_t from, int64_t to) {
  for (int64_t r = 0; r < kChunk; ++r)
    if (r >= from && r < to)
      for (int64_t line = 0; line < HeadDim * int64_t(sizeof(K)); line += 64)
        request_line(reinterpret_cast<const char*>(rows + r * HeadDim) + line);
}

// What a chunk requests as it is read: the rows that row i of the chunk maps to, keys + i * D
// and values + i * D for i < rows (the query's next chunk, or the first chunk of the next work
// item when this is the query's last: rows in a run of slots, as in a cached prefix).
template <typename K>
struct Ahead {
  const K* keys = nullptr;
  const K* values = nullptr;
  int64_t rows = 0;
};
#ifdef __AVX512F__
constexpr int kScoreQueries = 8;  // queries x 16 keys of scores in registers
#else
constexpr int kScoreQueries = 4;
#endif

#ifdef __AVX512F__
// Four dims of a key as float32: from a float32 cache, or widened exactly from a float16 one.
inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 load4(const c10::Half* p) { return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// Key j of 16: any rows (16 pointers), or 16 consecutive rows of a cache (one pointer, fixed
// offsets: no pointers to keep in registers).
template <typename K>
struct ScatteredKeys {
  const K* const* rows;
  const K* operator()(int j) const { return rows[j]; }
};
template <typename K, int64_t HeadDim>
struct ConsecutiveKeys {
  const K* first;
  const K* operator()(int j) const { return first + j * HeadDim; }
};

// Dims d .. d + 3 of 16 keys, transposed: out[e] = dim d + e of keys 0..15. Four keys' dims in
// each 128-bit lane as they load, then 4 x 4 transposes within the lanes.
template <typename Keys>
inline void transpose4(const Keys& key, int64_t d, __m512 out[4]) {
  __m512 a[4];
  for (int j = 0; j < 4; ++j) {  // lane L: key 4L + j
    const __m512 r = _mm512_castps128_ps512(load4(key(j) + d));
    a[j] = _mm512_insertf32x4(_mm512_insertf32x4(_mm512_insertf32x4(r, load4(key(4 + j) + d), 1), load4(key(8 + j) + d), 2),
                              load4(key(12 + j) + d), 3);
  }
  const __m512 t0 = _mm512_unpacklo_ps(a[0], a[1]), t1 = _mm512_unpackhi_ps(a[0], a[1]);
  const __m512 t2 = _mm512_unpacklo_ps(a[2], a[3]), t3 = _mm512_unpackhi_ps(a[2], a[3]);
  out[0] = _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  out[1] = _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  out[2] = _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  out[3] = _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
}

// Dims d .. d + 15 of 16 consecutive float16 keys (`first` points at key 0's dim d, `stride`
// halves apart), transposed and widened: out[e] = dim d + e of keys 0..15. The transpose runs on
// the 16-bit values, two keys to a register (key j and key j + 8), and each dim is widened once
// as 16 keys: 3 shuffles and one widening per 16 values where transpose4 takes 5 and four. The
// values are transpose4's, so the FMAs that read them give the same bits.
inline void transpose16_half(const c10::Half* first, int64_t stride, __m512 out[16]) {
  __m512i r[8];  // lanes: key j dims 0-7, key j dims 8-15, key j + 8 dims 0-7, key j + 8 dims 8-15
  for (int j = 0; j < 8; ++j) {
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + j * stride));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + (j + 8) * stride));
    r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  // a[p] / a[4 + p]: keys 2p, 2p + 1 interleaved, dims 0-3 / 4-7 of each lane's eight
  __m512i a[8];
  for (int p = 0; p < 4; ++p) {
    a[p] = _mm512_unpacklo_epi16(r[2 * p], r[2 * p + 1]);
    a[4 + p] = _mm512_unpackhi_epi16(r[2 * p], r[2 * p + 1]);
  }
  // b[4h + 2k + i]: keys 4k .. 4k + 3, 64 bits per dim: dims 4h + 2i, 4h + 2i + 1 of the lane
  __m512i b[8];
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 2; ++k) {
      b[4 * h + 2 * k] = _mm512_unpacklo_epi32(a[4 * h + 2 * k], a[4 * h + 2 * k + 1]);
      b[4 * h + 2 * k + 1] = _mm512_unpackhi_epi32(a[4 * h + 2 * k], a[4 * h + 2 * k + 1]);
    }
  // c[e]: dim e of keys 0-7, dim 8 + e of keys 0-7, dim e of keys 8-15, dim 8 + e of keys 8-15
  const __m512i order = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 2; ++i) {
      const __m512i even = _mm512_unpacklo_epi64(b[4 * h + i], b[4 * h + 2 + i]);
      const __m512i odd = _mm512_unpackhi_epi64(b[4 * h + i], b[4 * h + 2 + i]);
      const int e = 4 * h + 2 * i;
      for (const auto& [dim, c] : {std::pair<int, __m512i>{e, even}, {e + 1, odd}}) {
        const __m512i both = _mm512_permutexvar_epi64(order, c);  // dim: keys 0-15, then dim + 8
        out[dim] = _mm512_cvtph_ps(_mm512_castsi512_si256(both));
        out[dim + 8] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(both, 1));
      }
    }
}
#endif

// The 16 keys of block `block` of a chunk: slots[i] for i < n (a short block repeats key n - 1).
template <int NV, typename K>
void block_keys(const K* kb, const int32_t* slots, int64_t n, int64_t block, const K* k[16]) {
  for (int j = 0; j < 16; ++j) k[j] = kb + int64_t(slots[std::min<int64_t>(16 * block + j, n - 1)]) * (16 * NV);
}

// The keys of a chunk into its transposed tile, kt[d * kChunk + i] = dim d of key i: blocks
// `first` .. `last` - 1 of 16 keys.
template <int NV, typename K>
void transpose_keys(const K* kb, const int32_t* slots, int64_t n, int64_t first, int64_t last, float* kt,
                    Ahead<K> ahead) {
  for (int64_t block = first; block < last; ++block) {
    const K* k[16];
    block_keys<NV>(kb, slots, n, block, k);
    if (16 * block < ahead.rows)
      for (int j = 0; j < 16; ++j)
        for (int64_t line = 0; line < 16 * NV * int64_t(sizeof(K)); line += 64)
          request_line(reinterpret_cast<const char*>(ahead.keys + (16 * block + j) * 16 * NV) + line);
#ifdef __AVX512F__
    const auto transpose = [&](const auto& keys) {
      for (int64_t d = 0; d < 16 * NV; d += 4) {
        __m512 dims[4];
        transpose4(keys, d, dims);
        for (int e = 0; e < 4; ++e) _mm512_store_ps(kt + (d + e) * kChunk + 16 * block, dims[e]);
      }
    };
    // 16 consecutive slots: a whole block (a short one repeats its last key, so its first and
    // last pointers may be 15 rows apart over a gap) whose slots run without a gap
    const int64_t start = 16 * block;
    if (start + 15 < n && slots[start + 15] - slots[start] == 15) {
      transpose(ConsecutiveKeys<K, 16 * NV>{k[0]});
    } else {
      transpose(ScatteredKeys<K>{k});
    }
#else
    for (int half = 0; half < 2; ++half)
      for (int c = 0; c < 2 * NV; ++c) {  // dims 8c .. 8c + 7 of keys 8 half .. 8 half + 7: an 8 x 8 transpose
        __m256 r[8], t[8];
        for (int j = 0; j < 8; ++j) r[j] = load8(k[8 * half + j] + 8 * c);
        for (int j = 0; j < 8; j += 2) {
          t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
          t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
        }
        for (int j = 0; j < 8; j += 4) {
          r[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
          r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
          r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
          r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
        }
        float* column = kt + 8 * c * kChunk + 16 * block + 8 * half;
        for (int e = 0; e < 4; ++e) {
          _mm256_store_ps(column + e * kChunk, _mm256_permute2f128_ps(r[e], r[4 + e], 0x20));
          _mm256_store_ps(column + (4 + e) * kChunk, _mm256_permute2f128_ps(r[e], r[4 + e], 0x31));
        }
      }
#endif
  }
}

// Scores of M queries against the tile's keys 16 v0 .. 16 (v0 + V) - 1, unscaled: per key, the
// FMA chain over the dims in order from zero.
template <int NV, int M, int V>
void score_vectors(const float* const q[], const float* kt, int64_t v0, float (*scores)[kChunk]) {
  Floats16 acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < V; ++u) acc[m][u] = Floats16::zero();
  for (int d = 0; d < 16 * NV; ++d) {
    Floats16 key[V];
    for (int u = 0; u < V; ++u) key[u] = Floats16::load(kt + d * kChunk + 16 * (v0 + u));
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < V; ++u) acc[m][u].fma(q[m][d], key[u]);
  }
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < V; ++u) acc[m][u].store(scores[m] + 16 * (v0 + u));
}

// The same for the tile's keys 0 .. 16 * vectors - 1, V vectors of 16 keys at a time so that
// M * V chains hide the FMA latency (V does not change a bit).
template <int NV, int M>
void score_block(const float* const query[], const float* kt, int64_t vectors, float (*scores)[kChunk]) {
#ifdef __AVX512F__
  constexpr int V = M == 1 ? 4 : M <= 4 ? 2 : 1;
#else
  constexpr int V = M <= 2 ? 2 : 1;
#endif
  const float* q[M];
  for (int m = 0; m < M; ++m) q[m] = query[m];
  int64_t v = 0;
  for (; v + V <= vectors; v += V) score_vectors<NV, M, V>(q, kt, v, scores);
  for (; v < vectors; ++v) score_vectors<NV, M, 1>(q, kt, v, scores);
}

#ifdef __AVX512F__
// score_block for queries that share no tile with others (a one-token step, a tree node's own
// chunk): each 16-key block is transposed in registers as the FMAs consume it, no tile stored.
// The same chains, so the same bits.
template <int NV, int M, int V, typename Keys>
void direct_vectors(const float* const q[], const Keys (&keys)[V], int64_t v0, float (*scores)[kChunk],
                    Ahead<c10::Half> ahead) {
  Floats16 acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < V; ++u) acc[m][u] = Floats16::zero();
  // 16 consecutive keys of a float16 cache (its cached prefix): transpose16_half's case
  if constexpr (std::is_same_v<Keys, ConsecutiveKeys<c10::Half, 16 * NV>>) {
    constexpr int64_t kPart = 16 * 16 * NV * int64_t(sizeof(c10::Half)) / NV;  // a block's bytes / NV
    for (int64_t d = 0; d < 16 * NV; d += 16)
      for (int u = 0; u < V; ++u) {
        if (16 * (v0 + u) < ahead.rows) {  // the block's requests: a part per 16 dims
          const char* part = reinterpret_cast<const char*>(ahead.keys + 16 * (v0 + u) * 16 * NV) + d / 16 * kPart;
          for (int64_t line = 0; line < kPart; line += 64) request_line(part + line);
        }
        __m512 dims[16];
        transpose16_half(keys[u].first + d, 16 * NV, dims);
        for (int e = 0; e < 16; ++e)
          for (int m = 0; m < M; ++m) acc[m][u].fma_at(q[m] + d + e, Floats16{dims[e]});
      }
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < V; ++u) acc[m][u].store(scores[m] + 16 * (v0 + u));
    return;
  }
  for (int64_t d = 0; d < 16 * NV; d += 4) {
    __m512 dims[V][4];
    for (int u = 0; u < V; ++u) transpose4(keys[u], d, dims[u]);
    for (int e = 0; e < 4; ++e)
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < V; ++u) acc[m][u].fma_at(q[m] + d + e, Floats16{dims[u][e]});
  }
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < V; ++u) acc[m][u].store(scores[m] + 16 * (v0 + u));
}

// Blocks v0 .. v0 + V - 1 of 16 keys: from one pointer where their slots are consecutive (the
// cached prefix), else from 16 V.
template <int NV, int M, int V, typename K>
void direct_blocks(const float* const q[], const K* kb, const int32_t* slots, int64_t n, int64_t v0,
                   float (*scores)[kChunk], Ahead<K> ahead) {
  constexpr int64_t head_dim = 16 * NV;
  const int64_t first = 16 * v0, last = 16 * (v0 + V) - 1;
  if (last < n && slots[last] - slots[first] == last - first) {
    ConsecutiveKeys<K, head_dim> keys[V];
    for (int u = 0; u < V; ++u) keys[u] = {kb + (int64_t(slots[first]) + 16 * u) * head_dim};
    if constexpr (std::is_same_v<K, c10::Half>) {
      direct_vectors<NV, M, V>(q, keys, v0, scores, ahead);
    } else {
      direct_vectors<NV, M, V>(q, keys, v0, scores, Ahead<c10::Half>{});
    }
    return;
  }
  // A chunk's short last block: the rest of what the chunk requests, at once (after a query's
  // last chunk, the next head's or request's first chunk, whose later rows no block asked for)
  if (last >= n) request_rows<head_dim>(ahead.keys, first, ahead.rows);
  const K* rows[V][16];
  ScatteredKeys<K> keys[V];
  for (int u = 0; u < V; ++u) block_keys<NV>(kb, slots, n, v0 + u, rows[u]), keys[u] = {rows[u]};
  direct_vectors<NV, M, V>(q, keys, v0, scores, Ahead<c10::Half>{});
}

template <int NV, int M, typename K>
void score_direct(const float* const query[], const K* kb, const int32_t* slots, int64_t n, float (*scores)[kChunk],
                  Ahead<K> ahead) {
  constexpr int V = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  const float* q[M];
  for (int m = 0; m < M; ++m) q[m] = query[m];
  const int64_t vectors = (n + 15) / 16;
  int64_t v = 0;
  for (; v + V <= vectors; v += V) direct_blocks<NV, M, V>(q, kb, slots, n, v, scores, ahead);
  for (; v < vectors; ++v) direct_blocks<NV, M, 1>(q, kb, slots, n, v, scores, ahead);
}
#endif

// One query of a chunk: its keys there are the tile's first n.
struct ChunkQuery {
  const float* q;  // [head_dim]
  float* part;  // receives max, sum, then the head_dim weighted sums
  int64_t n;  // 1 .. 64
};

// The weighted sums of G queries over dims 16 first .. 16 (first + NV) - 1 of their value rows
// (rows of 16 * Width values), slots[i] for i < n of each (that part of a row loaded once for all
// of them); probs [G][kChunk]. Where many queries share a chunk (AVX-512), a head_dim-128 row is
// taken in two parts of kValuePart vectors, one call each, for 4 queries instead of the whole
// row for 2 (whose 16 accumulators left one load per FMA): each dim's sum is the same chain over
// the keys in order whichever part it is in, so the same bits. With the widened rows below,
// Qwen2.5-Coder-1.5B's attention (scripts/ab-attention.py, 1 thread, AMD Zen 4) ran 1.09-1.13x
// as fast on prefill chunks of 256 rows and 1.06x on trees of 8-32 rows.
template <int NV, int G, int Width, typename V, typename K>
void value_block(const ChunkQuery* queries, const float (*probs)[kChunk], const V* vb, const int32_t* slots,
                 Ahead<K> ahead, int first) {
  constexpr int64_t head_dim = 16 * Width;
  int64_t shortest = kChunk, longest = 0;
  for (int g = 0; g < G; ++g) shortest = std::min(shortest, queries[g].n), longest = std::max(longest, queries[g].n);
  Floats16 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = Floats16::zero();
  vb += 16 * first;
  for (int64_t i = 0; i < shortest; ++i) {
    const V* vr = vb + int64_t(slots[i]) * head_dim;
    if (i < ahead.rows)
      for (int64_t line = 0; line < head_dim * int64_t(sizeof(K)); line += 64)
        request_line(reinterpret_cast<const char*>(ahead.values + i * head_dim) + line);
    for (int c = 0; c < NV; ++c) {
      const Floats16 value = Floats16::load(vr + 16 * c);
      for (int g = 0; g < G; ++g) acc[g][c].fma(probs[g][i], value);
    }
  }
  request_rows<head_dim>(ahead.values, shortest, ahead.rows);  // a short chunk: the rest, at once
  for (int64_t i = shortest; i < longest; ++i) {  // keys some of the G queries do not have
    const V* vr = vb + int64_t(slots[i]) * head_dim;
    for (int c = 0; c < NV; ++c) {
      const Floats16 value = Floats16::load(vr + 16 * c);
      for (int g = 0; g < G; ++g)
        if (i < queries[g].n) acc[g][c].fma(probs[g][i], value);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c].store(queries[g].part + 2 + 16 * (first + c));
}

// Queries whose weighted sums value_block keeps in registers at once: whole rows of NV vectors
// (kValueQueries), or, where many queries share a chunk, parts of a wider row of kValuePart
// vectors (kPartQueries).
constexpr int kValuePart = 4;
#ifdef __AVX512F__
template <int NV>
constexpr int kValueQueries = NV == 4 ? 4 : 2;
constexpr int kPartQueries = 4;
#else
template <int NV>
constexpr int kValueQueries = 1;
constexpr int kPartQueries = 1;
#endif

// value_block for n (1 .. kPartQueries) queries: Part vectors from vector `first` of rows of Width.
template <int Part, int Width, typename V, typename K>
void value_groups(int n, const ChunkQuery* queries, const float (*probs)[kChunk], const V* vb, const int32_t* slots,
                  Ahead<K> ahead, int first) {
  switch (n) {
    case 1: value_block<Part, 1, Width>(queries, probs, vb, slots, ahead, first); break;
#ifdef __AVX512F__
    case 2: value_block<Part, 2, Width>(queries, probs, vb, slots, ahead, first); break;
    case 3: value_block<Part, 3, Width>(queries, probs, vb, slots, ahead, first); break;
    case 4: value_block<Part, 4, Width>(queries, probs, vb, slots, ahead, first); break;
#endif
  }
}

// Rows 0 .. kChunk - 1 in order: the slots of a chunk's widened values (widen_values).
constexpr std::array<int32_t, kChunk> kInOrder = [] {
  std::array<int32_t, kChunk> rows{};
  for (int32_t i = 0; i < int32_t(kChunk); ++i) rows[i] = i;
  return rows;
}();

// The value rows slots[i], i < n, of a float16 chunk widened (exactly) to float32 rows 0 .. n - 1 of
// `tile`, for a chunk that several groups of queries read: value_block then loads plain floats,
// and each row is widened once instead of once per kValueQueries queries. The same floats, so the
// same bits. AVX-512 only (4 queries per loaded row, or per half row at head_dim 128): on AVX2,
// where each query reads the rows alone, the float tile (twice the float16 rows' bytes, beside
// the keys' tile in L1) made a 256-token chunk's attention after 1,792 cached 1.45x as slow
// (AMD Zen 4, 2 threads, the haswell build).
template <int NV, typename K>
void widen_values(const K* vb, const int32_t* slots, int64_t n, float* tile) {
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < NV; ++c)
      Floats16::load(vb + int64_t(slots[i]) * (16 * NV) + 16 * c).store(tile + i * (16 * NV) + 16 * c);
}

// Partial softmaxes of `count` queries over one chunk: keys and values the rows slots[i] of kb
// and vb (the values rows value_slots[i] of vb where given: a widened tile), the keys read from
// their transposed tile kt, or (kt null, AVX-512 only) transposed as they are scored.
template <int NV, typename K, typename V = K>
void chunk_partials(const ChunkQuery* queries, int64_t count, const float* kt, const K* kb, const V* vb,
                    const int32_t* slots, float scale, Ahead<K> next, const int32_t* value_slots = nullptr) {
  static_assert(NV % kValuePart == 0, "value rows are taken in parts of kValuePart vectors");
  if (value_slots == nullptr) value_slots = slots;
  alignas(64) float scores[kScoreQueries][kChunk];
  for (int64_t b0 = 0; b0 < count; b0 += kScoreQueries) {
    const ChunkQuery* block = queries + b0;
    const Ahead<K> ahead = b0 == 0 ? next : Ahead<K>{};  // requested once
    const int size = int(std::min<int64_t>(kScoreQueries, count - b0));
    int64_t longest = 0;
    const float* q[kScoreQueries];
    for (int m = 0; m < size; ++m) q[m] = block[m].q, longest = std::max(longest, block[m].n);
    const int64_t vectors = (longest + 15) / 16;
    // 1. Scores (the same chain for a key in any column of any tile).
#ifdef __AVX512F__
    if (!kt) {
      switch (size) {
        case 1: score_direct<NV, 1>(q, kb, slots, longest, scores, ahead); break;
        case 2: score_direct<NV, 2>(q, kb, slots, longest, scores, ahead); break;
        case 3: score_direct<NV, 3>(q, kb, slots, longest, scores, ahead); break;
        case 4: score_direct<NV, 4>(q, kb, slots, longest, scores, ahead); break;
        case 5: score_direct<NV, 5>(q, kb, slots, longest, scores, ahead); break;
        case 6: score_direct<NV, 6>(q, kb, slots, longest, scores, ahead); break;
        case 7: score_direct<NV, 7>(q, kb, slots, longest, scores, ahead); break;
        case 8: score_direct<NV, 8>(q, kb, slots, longest, scores, ahead); break;
      }
    } else {
      switch (size) {
        case 1: score_block<NV, 1>(q, kt, vectors, scores); break;
        case 2: score_block<NV, 2>(q, kt, vectors, scores); break;
        case 3: score_block<NV, 3>(q, kt, vectors, scores); break;
        case 4: score_block<NV, 4>(q, kt, vectors, scores); break;
        case 5: score_block<NV, 5>(q, kt, vectors, scores); break;
        case 6: score_block<NV, 6>(q, kt, vectors, scores); break;
        case 7: score_block<NV, 7>(q, kt, vectors, scores); break;
        case 8: score_block<NV, 8>(q, kt, vectors, scores); break;
      }
    }
#else
    (void)kb;
    switch (size) {
      case 1: score_block<NV, 1>(q, kt, vectors, scores); break;
      case 2: score_block<NV, 2>(q, kt, vectors, scores); break;
      case 3: score_block<NV, 3>(q, kt, vectors, scores); break;
      case 4: score_block<NV, 4>(q, kt, vectors, scores); break;
    }
#endif
    // 2. Softmax numerators over the full 64 entries: e^(score * scale - max), 0 for padding
    // (-inf); their sum in a fixed order.
    for (int m = 0; m < size; ++m) {
      float* row = scores[m];
      for (int64_t c = 0; c < vectors; ++c) (Floats16::load(row + 16 * c) * Floats16::fill(scale)).store(row + 16 * c);
      for (int64_t i = block[m].n; i < 16 * vectors; ++i) row[i] = -INFINITY;
      // The vectors past `vectors` hold padding alone: max(x, -inf) = x, e^-inf = 0 (as exp16
      // gives it) and x + 0 = x, so they are skipped with the same bits.
      Floats16 top = Floats16::load(row);
      for (int64_t c = 1; c < vectors; ++c) top = max(top, Floats16::load(row + 16 * c));
      const float best = top.max_lane();  // a max is exact in any order
      const Floats16 shift = Floats16::fill(best);
      Floats16 probs[kChunk / 16] = {Floats16::zero(), Floats16::zero(), Floats16::zero(), Floats16::zero()};
      for (int64_t c = 0; c < vectors; ++c) probs[c] = exp16(Floats16::load(row + 16 * c) - shift);
      const Floats16 sum = (probs[0] + probs[1]) + (probs[2] + probs[3]);
      block[m].part[0] = best;
      block[m].part[1] = sum8_tree(sum.half_sum());
      for (int c = 0; c < kChunk / 16; ++c) probs[c].store(row + 16 * c);  // scores -> probabilities
    }
    // 3. Weighted sums of the value rows.
    // (Whole rows where few queries read the chunk: a one-token step's head_dim-128 rows in
    // parts were 0.85x as fast, each part's lines arriving apart; and on AVX2, one query a pass,
    // parts gain nothing: 0.97-1.00x.)
    const bool in_parts = NV > kValuePart && kPartQueries > kValueQueries<NV> && count > kScoreQueries;
    const int per_pass = in_parts ? kPartQueries : kValueQueries<NV>;
    for (int g0 = 0; g0 < size; g0 += per_pass) {
      const int n = std::min(per_pass, size - g0);
      if (!in_parts) {
        value_groups<NV, NV>(n, block + g0, scores + g0, vb, value_slots, g0 == 0 ? ahead : Ahead<K>{}, 0);
        continue;
      }
      for (int first = 0; first < NV; first += kValuePart)
        value_groups<kValuePart, NV>(n, block + g0, scores + g0, vb, value_slots,
                                     g0 == 0 && first == 0 ? ahead : Ahead<K>{}, first);
    }
  }
}

// Float scratch that persists between the calls of one calling thread (no allocation or
// zeroing per layer); written and read by the worker threads of one call.
float* scratch(int64_t count) {
  static thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

template <int NV, typename K>
void chunked_attention(const float* q, const K* keys, const K* values, const Visibility& visible,
                       int64_t heads, int64_t kv_heads, int64_t max_slots, float* out) {
  constexpr int64_t head_dim = 16 * NV;
#ifdef __AVX512F__
  constexpr bool direct = true;  // queries that fill at most one block score straight from the cache
#else
  constexpr bool direct = false;
#endif
  const int64_t group = heads / kv_heads, rows = visible.rows(), runs = int64_t(visible.runs.size()) - 1;
  const float scale = float(1.0 / std::sqrt(double(head_dim)));
  const int64_t chunks = (visible.longest + kChunk - 1) / kChunk;
  // partials[(row, kvh, chunk), query of the group]: max, sum, then head_dim weighted sums;
  // max = -inf: empty
  constexpr int64_t stride = head_dim + 2;
  float* partials = scratch(rows * kv_heads * chunks * group * stride);
  const int64_t items = runs * kv_heads * chunks;
  int64_t longest_run = 0;
  for (int64_t r = 0; r < runs; ++r) longest_run = std::max(longest_run, visible.runs[r + 1] - visible.runs[r]);
  // The whole region's multiply-adds (at most): a ragged pass's many short sequences together
  // are worth the threads even where each alone is not.
  const int64_t work = rows * group * visible.longest * head_dim;
  eyas::parallel_for(0, items, work >= (1 << 14) ? 1 : items, [&](int64_t begin, int64_t end) {
    alignas(64) float shared_tile[head_dim * kChunk], own_tile[head_dim * kChunk], value_tile[head_dim * kChunk];
    std::vector<ChunkQuery> sharing, own(group);
    std::vector<int64_t> own_rows;
    sharing.reserve(longest_run * group), own_rows.reserve(longest_run);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t run = item / (kv_heads * chunks), kvh = (item / chunks) % kv_heads, chunk = item % chunks;
      const int64_t first_row = visible.runs[run], end_row = visible.runs[run + 1];
      const int64_t b = visible.sequences[first_row];
      const K* kb = keys + (b * kv_heads + kvh) * max_slots * head_dim;
      const K* vb = values + (b * kv_heads + kvh) * max_slots * head_dim;
      const auto keys_of = [&](int64_t row, int64_t c = -1) {  // the row's visible keys in chunk c (<= 0: none)
        return std::min<int64_t>(kChunk, visible.offsets[row + 1] - visible.offsets[row] - (c < 0 ? chunk : c) * kChunk);
      };
      // What a row's chunk requests as it is read: the row's next chunk, or after its last
      // (`then_item`) the first chunk of the thread's next item, whether or not in this range
      // (a thread claims its segment's chunks front to back).
      const auto next_of = [&](int64_t row, bool then_item) {
        const int64_t rows = keys_of(row, chunk + 1);
        if (rows > 0) {
          const int64_t first = visible.slots[visible.offsets[row] + (chunk + 1) * kChunk];
          return Ahead<K>{kb + first * head_dim, vb + first * head_dim, rows};
        }
        if (!then_item || item + 1 >= items) return Ahead<K>{};
        const int64_t next = item + 1, next_chunk = next % chunks, next_kvh = (next / chunks) % kv_heads;
        const int64_t next_row = visible.runs[next / (kv_heads * chunks)];
        const int64_t next_rows = keys_of(next_row, next_chunk);
        if (next_rows <= 0) return Ahead<K>{};
        const int64_t first = visible.slots[visible.offsets[next_row] + next_chunk * kChunk];
        const int64_t stream = (visible.sequences[next_row] * kv_heads + next_kvh) * max_slots;
        return Ahead<K>{keys + (stream + first) * head_dim, values + (stream + first) * head_dim, next_rows};
      };
      const auto query = [&](int64_t row, int64_t g, int64_t n) {
        const int64_t h = kvh * group + g;
        return ChunkQuery{q + (row * heads + h) * head_dim,
                          partials + (((row * kv_heads + kvh) * chunks + chunk) * group + g) * stride, n};
      };
      // 1. The reference: the chunk of the run's row that sees the most keys there.
      int64_t reference = first_row, reference_n = keys_of(first_row);
      for (int64_t row = first_row + 1; row < end_row; ++row)
        if (keys_of(row) > reference_n) reference = row, reference_n = keys_of(row);
      const int32_t* reference_slots = visible.slots.data() + visible.offsets[reference] + chunk * kChunk;
      // 2. Each row's queries share the reference's keys (its keys there are the reference's
      // first n), or are scored on their own.
      sharing.clear(), own_rows.clear();
      for (int64_t row = first_row; row < end_row; ++row) {
        const int64_t n = keys_of(row);
        if (n <= 0) {  // fewer visible keys than this chunk starts at
          for (int64_t g = 0; g < group; ++g) query(row, g, 0).part[0] = -INFINITY;
          continue;
        }
        const int32_t* row_slots = visible.slots.data() + visible.offsets[row] + chunk * kChunk;
        if (std::equal(row_slots, row_slots + n, reference_slots)) {
          for (int64_t g = 0; g < group; ++g) sharing.push_back(query(row, g, n));
        } else {
          own_rows.push_back(row);
        }
      }
      // 3. The shared keys: transposed into a tile once where more than one block of queries
      // reads them.
      const int64_t count = int64_t(sharing.size());
      const bool tiled = !direct || count > kScoreQueries;
      const Ahead<K> reference_next = next_of(reference, true);
      if (tiled && count > 0)
        transpose_keys<NV>(kb, reference_slots, reference_n, 0, (reference_n + 15) / 16, shared_tile, reference_next);
      if (std::is_same_v<K, at::Half> && kValueQueries<NV> > 1 && count > kScoreQueries) {  // widen_values
        widen_values<NV>(vb, reference_slots, reference_n, value_tile);
        chunk_partials<NV>(sharing.data(), count, tiled ? shared_tile : nullptr, kb, value_tile, reference_slots,
                           scale, reference_next, kInOrder.data());
      } else if (count > 0) {
        chunk_partials<NV>(sharing.data(), count, tiled ? shared_tile : nullptr, kb, vb, reference_slots, scale,
                           reference_next);
      }
      // 4. The rows that share nothing: their own keys (in a tile: the shared one's whole blocks
      // of 16 equal to theirs copied, the rest transposed).
      for (int64_t row : own_rows) {
        const int64_t n = keys_of(row);
        const int32_t* row_slots = visible.slots.data() + visible.offsets[row] + chunk * kChunk;
        for (int64_t g = 0; g < group; ++g) own[g] = query(row, g, n);
        if (direct && group <= kScoreQueries) {
          chunk_partials<NV>(own.data(), group, nullptr, kb, vb, row_slots, scale, next_of(row, false));
          continue;
        }
        int64_t copied = 0;
        if (tiled && count > 0)
          while (copied < n / 16 && std::equal(row_slots + 16 * copied, row_slots + 16 * copied + 16, reference_slots + 16 * copied))
            ++copied;
        for (int64_t d = 0; d < head_dim; ++d)
          std::copy(shared_tile + d * kChunk, shared_tile + d * kChunk + 16 * copied, own_tile + d * kChunk);
        const Ahead<K> next = next_of(row, false);
        transpose_keys<NV>(kb, row_slots, n, copied, (n + 15) / 16, own_tile, next);
        chunk_partials<NV>(own.data(), group, own_tile, kb, vb, row_slots, scale, next);
      }
    }
  });
  // Combine each query's chunks in order: the softmax over all its visible keys.
  eyas::parallel_for(0, rows * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t row = index / heads, h = index % heads, kvh = h / group;
      const float* base = partials + ((row * kv_heads + kvh) * chunks * group + h % group) * stride;
      float best = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) best = std::max(best, base[c * group * stride]);
      float total = 0.0f;
      Floats16 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = Floats16::zero();
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = base + c * group * stride;
        if (part[0] == -INFINITY) continue;
        const float weight = float(std::exp(double(part[0]) - double(best)));
        total += weight * part[1];
        for (int v = 0; v < NV; ++v) acc[v].fma(weight, Floats16::load(part + 2 + 16 * v));
      }
      const float inverse = 1.0f / total;
      float* o = out + (row * heads + h) * head_dim;
      for (int v = 0; v < NV; ++v) acc[v].store_scaled(o + 16 * v, inverse);
    }
  });
}
#endif

}  // namespace

Visibility::Visibility(const bool* mask_in, int64_t kv_len_in, std::vector<int64_t> sequences_in)
    : sequences(std::move(sequences_in)), mask(mask_in), kv_len(kv_len_in) {
  const int64_t rows = int64_t(sequences.size());
  for (int64_t r = 0; r < rows; ++r)
    if (r == 0 || sequences[r] != sequences[r - 1]) runs.push_back(r);
  runs.push_back(rows);
  offsets.reserve(rows + 1);
  offsets.push_back(0);
  slots.reserve(rows * kv_len);
  for (int64_t r = 0; r < rows; ++r) {
    const bool* row = mask ? mask + r * kv_len : nullptr;
    for (int64_t s = 0; s < kv_len; ++s)
      if (!row || row[s]) slots.push_back(int32_t(s));
    offsets.push_back(int64_t(slots.size()));
    longest = std::max(longest, offsets[r + 1] - offsets[r]);
  }
}

void attention(const float* q, const float* keys, const float* values, const Visibility& visible, int64_t heads,
               int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out) {
#ifdef EYAS_CHUNKED_ATTENTION
  if (head_dim == 64 || head_dim == 128) {
    (head_dim == 64 ? chunked_attention<4, float> : chunked_attention<8, float>)(
        q, keys, values, visible, heads, kv_heads, max_slots, out);
    return;
  }
#endif
  generic_attention<float>(q, keys, values, visible, heads, kv_heads, head_dim, max_slots, out);
}

void attention(const float* q, const at::Half* keys, const at::Half* values, const Visibility& visible,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out) {
#ifdef EYAS_CHUNKED_ATTENTION
  if (head_dim == 64 || head_dim == 128) {
    (head_dim == 64 ? chunked_attention<4, at::Half> : chunked_attention<8, at::Half>)(
        q, keys, values, visible, heads, kv_heads, max_slots, out);
    return;
  }
#endif
  (void)q, (void)keys, (void)values, (void)visible, (void)heads, (void)kv_heads, (void)max_slots, (void)out;
  throw std::invalid_argument("a float16 KV cache needs head_dim 64 or 128 and a CPU with AVX2, FMA and F16C");
}

void attention(const double* q, const double* keys, const double* values, const Visibility& visible,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_slots, float* out) {
  generic_attention<double>(q, keys, values, visible, heads, kv_heads, head_dim, max_slots, out);
}

}  // namespace eyas
