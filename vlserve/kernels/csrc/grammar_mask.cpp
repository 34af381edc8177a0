// A grammar's token bitmask applied to logits in place (see vlserve/kernels/grammar_mask.py); built through inductor's
// C++ toolchain. Bit j of int32 word w set: token 32 w + j is allowed; tokens at or past 32 W are forbidden; bits past
// the vocabulary are ignored. Forbidden logits get -inf, written as its bit pattern in the logits' dtype (what
// masked_fill writes), so the result is bit-exact with the numpy / torch path.
#include <omp.h>
#include <algorithm>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

constexpr int64_t kMinTokensPerThread = 32768;  // below this a thread costs more to start than it saves
constexpr uint32_t kAll = 0xffffffffu;

// the first index in [w, end) whose word is not `value` (end if none); eight words a compare with AVX2
static inline int64_t run_end(const int32_t* words, int64_t w, int64_t end, uint32_t value) {
#if defined(__AVX2__)
    const __m256i v = _mm256_set1_epi32(int32_t(value));
    for (; w + 8 <= end; w += 8) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + w));
        const uint32_t same = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, v))));
        if (same != 0xffu) return w + __builtin_ctz(~same);
    }
#endif
    while (w < end && uint32_t(words[w]) == value) ++w;
    return w;
}

// -inf into the logits of the set bits of `forbidden` (tokens 0..31 of `p`), one at a time
template <typename T>
static inline void mask_bits(T* p, uint32_t forbidden, T neg) {
    while (forbidden) {
        p[__builtin_ctz(forbidden)] = neg;
        forbidden &= forbidden - 1;
    }
}

// -inf into the 32 logits at `p` whose bits of `word` are clear (a word with both kinds of bits)
static inline void mask_word(uint32_t* p, uint32_t word, uint32_t neg) {
#if defined(__AVX2__)
    // lane i of group g gets bit 8 g + i of the forbidden bits in its sign bit, which blendv reads
    const __m256i shifts = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
    const __m256 ninf = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(neg)));
    const uint32_t forbidden = ~word;
    float* f = reinterpret_cast<float*>(p);
    for (int g = 0; g < 4; ++g) {
        const __m256i sel = _mm256_sllv_epi32(_mm256_set1_epi32(int32_t(forbidden >> (8 * g))), shifts);  // [8]
        _mm256_storeu_ps(f + 8 * g, _mm256_blendv_ps(_mm256_loadu_ps(f + 8 * g), ninf, _mm256_castsi256_ps(sel)));
    }
#else
    mask_bits(p, ~word, neg);
#endif
}

static inline void mask_word(uint16_t* p, uint32_t word, uint16_t neg) {
#if defined(__AVX2__)
    // lane i of half h: all ones where bit 16 h + i of the forbidden bits is set
    const __m256i bits = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                           int16_t(16384), int16_t(-32768));
    const __m256i ninf = _mm256_set1_epi16(int16_t(neg));
    const uint32_t forbidden = ~word;
    for (int h = 0; h < 2; ++h) {
        const __m256i sel = _mm256_cmpeq_epi16(
            _mm256_and_si256(_mm256_set1_epi16(int16_t(forbidden >> (16 * h))), bits), bits);  // [16]
        __m256i* q = reinterpret_cast<__m256i*>(p + 16 * h);
        _mm256_storeu_si256(q, _mm256_blendv_epi8(_mm256_loadu_si256(q), ninf, sel));
    }
#else
    mask_bits(p, ~word, neg);
#endif
}

// -inf into the n logits at `p`: whole vectors, then one at a time (std::fill measured ~3x slower here)
template <typename T>
static inline void fill(T* p, int64_t n, T neg) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i v = sizeof(T) == 4 ? _mm256_set1_epi32(int32_t(neg)) : _mm256_set1_epi16(int16_t(neg));
    constexpr int64_t kPer = 32 / sizeof(T);  // logits a vector
    for (; i + kPer <= n; i += kPer) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), v);
#endif
    for (; i < n; ++i) p[i] = neg;
}

// Masks the tokens of words [w0, w1) of one row: row [V] logits, words [W] its bitmask row.
template <typename T>
static void mask_range(T* row, const int32_t* words, int64_t W, int64_t V, int64_t w0, int64_t w1, T neg) {
    const int64_t t1 = std::min(32 * w1, V);    // tokens [32 w0, t1) are this range's
    const int64_t with_bits = std::min(w1, W);  // words [w0, with_bits) come from the bitmask
    const int64_t full = std::min(with_bits, t1 / 32);  // of those, the ones with all 32 tokens in the row
    int64_t w = w0;
    while (w < full) {
        const uint32_t word = uint32_t(words[w]);
        if (word == kAll) {
            w = run_end(words, w + 1, full, kAll);
        } else if (word == 0) {
            const int64_t end = run_end(words, w + 1, full, 0);
            fill(row + 32 * w, 32 * (end - w), neg);
            w = end;
        } else {
            mask_word(row + 32 * w, word, neg);
            ++w;
        }
    }
    if (full < with_bits && full >= w0)  // the word the vocabulary ends in: its bits past V are ignored
        mask_bits(row + 32 * full, ~uint32_t(words[full]) & ((1u << (t1 - 32 * full)) - 1), neg);
    const int64_t past = 32 * std::max(w0, W);  // tokens past the bitmask's width are forbidden
    if (past < t1) fill(row + past, t1 - past, neg);
}

// logits [N, V] (rows ld apart), mask [M, W] (rows ldm apart); R pairs (logit row, mask row): logit_rows[i] and
// mask_rows[i], or row i and row i without rows. Each row is split into `chunks` word ranges so that a few rows
// still keep every thread busy; the (row, range) units are shared out dynamically.
template <typename T>
static void apply(T* logits, int64_t ld, const int32_t* mask, int64_t ldm, const int64_t* logit_rows,
                  const int64_t* mask_rows, int64_t R, int64_t V, int64_t W, int64_t threads, T neg) {
    const int64_t row_words = (V + 31) / 32;
    const int64_t nt = std::max<int64_t>(1, std::min(threads, R * V / kMinTokensPerThread));
    const int64_t chunks = R >= nt ? 1 : (nt + R - 1) / R;
    const int64_t span = (row_words + chunks - 1) / chunks;  // words per unit
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t u = 0; u < R * chunks; ++u) {
        const int64_t i = u / chunks, w0 = (u % chunks) * span;
        const int64_t lr = logit_rows ? logit_rows[i] : i, mr = mask_rows ? mask_rows[i] : i;
        if (w0 < row_words)
            mask_range(logits + lr * ld, mask + mr * ldm, W, V, w0, std::min(w0 + span, row_words), neg);
    }
}

// dtype: 0 float32, 1 bfloat16, 2 float16 (-inf: 0xff800000, 0xff80, 0xfc00). has_rows 0: logit row i takes mask
// row i for i < R (the row arrays are not read).
extern "C" void kernel(void* logits, int64_t ld, const int32_t* mask, int64_t ldm, const int64_t* logit_rows,
                       const int64_t* mask_rows, int64_t has_rows, int64_t R, int64_t V, int64_t W, int64_t dtype,
                       int64_t threads) {
    if (!has_rows) logit_rows = mask_rows = nullptr;
    if (dtype == 0)
        apply<uint32_t>(static_cast<uint32_t*>(logits), ld, mask, ldm, logit_rows, mask_rows, R, V, W, threads,
                        0xff800000u);
    else
        apply<uint16_t>(static_cast<uint16_t*>(logits), ld, mask, ldm, logit_rows, mask_rows, R, V, W, threads,
                        uint16_t(dtype == 1 ? 0xff80 : 0xfc00));
}
