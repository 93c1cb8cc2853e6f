/* All-reduce (sum) of float32 tensors between the tensor-parallel ranks of one machine, through a
 * shared-memory segment: each rank copies its tensor into its slot, publishes a step counter
 * (release), waits until every rank published the same step (acquire), then sums the slots in
 * rank order, so every rank computes bit-identical results. Two buffers alternate between steps:
 * a rank can be at most one step ahead of the slowest, which has finished reading the buffer the
 * fast rank is about to overwrite (it published its next step only after reading).
 *
 * The same exchange serves the all-gather: each rank copies every slot out instead of summing.
 *
 * Segment layout: world flags of 64 bytes (one cache line each), then 2 x world x chunk floats.
 * Tensors longer than chunk go through in chunk-sized steps.
 */
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>

typedef struct {
    volatile int64_t seq;
    char pad[56];
} flag_t;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* 0 once every rank reached step, -1 after timeout_s (a peer died or hangs). Spins briefly, then
 * yields: with more ranks than cores a spinning rank would steal its peer's core. */
static int wait_all(flag_t *flags, int64_t world, int64_t step, double timeout_s) {
    for (int64_t r = 0; r < world; r++) {
        long spins = 0;
        double start = 0.0;
        while (__atomic_load_n(&flags[r].seq, __ATOMIC_ACQUIRE) < step) {
            if (++spins < 4096) continue;
            sched_yield();
            if (start == 0.0) start = now_s();
            else if ((spins & 1023) == 0 && now_s() - start > timeout_s) return -1;
        }
    }
    return 0;
}

/* One exchange step: copy this rank's m floats into its slot of the step's buffer, publish the
 * step, wait for every rank; returns the buffer (slot r at buf + r * chunk), or NULL on timeout. */
static float *exchange(void *base, const float *src, int64_t m, int64_t rank, int64_t world, int64_t chunk,
                       int64_t step, double timeout_s) {
    flag_t *flags = (flag_t *)base;
    float *buf = (float *)((char *)base + 64 * world) + (step & 1) * world * chunk;
    memcpy(buf + rank * chunk, src, (size_t)m * sizeof(float));
    __atomic_store_n(&flags[rank].seq, step, __ATOMIC_RELEASE);
    return wait_all(flags, world, step, timeout_s) ? NULL : buf;
}

/* x[0..n) = sum over ranks of each rank's x; returns the new step counter, or -1 on timeout. */
int64_t shm_all_reduce_f32(void *base, float *x, int64_t n, int64_t rank, int64_t world, int64_t chunk,
                           int64_t step, double timeout_s) {
    for (int64_t off = 0; off < n; off += chunk) {
        int64_t m = n - off < chunk ? n - off : chunk;
        float *buf = exchange(base, x + off, m, rank, world, chunk, ++step, timeout_s);
        if (!buf) return -1;
        float *out = x + off;
        memcpy(out, buf, (size_t)m * sizeof(float));
        for (int64_t r = 1; r < world; r++) {
            const float *s = buf + r * chunk;
            for (int64_t i = 0; i < m; i++) out[i] += s[i];
        }
    }
    return step;
}

/* out[r * n .. (r + 1) * n) = rank r's x[0..n), on every rank; the new step counter, or -1. */
int64_t shm_all_gather_f32(void *base, const float *x, float *out, int64_t n, int64_t rank, int64_t world,
                           int64_t chunk, int64_t step, double timeout_s) {
    for (int64_t off = 0; off < n; off += chunk) {
        int64_t m = n - off < chunk ? n - off : chunk;
        float *buf = exchange(base, x + off, m, rank, world, chunk, ++step, timeout_s);
        if (!buf) return -1;
        for (int64_t r = 0; r < world; r++) memcpy(out + r * n + off, buf + r * chunk, (size_t)m * sizeof(float));
    }
    return step;
}
