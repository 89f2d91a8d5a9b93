/* D-Lion's two elementwise passes on CPU, fused: the worker rule and the MaVo apply.
 *
 * Each computes exactly what the eager torch ops of distlion/methods/dlion.py compute, rounding for rounding:
 *   update   = fma(g, 1 - b1, m * b1)          torch.mul(m, b1).add_(g, alpha=1 - b1)
 *   sign bit = update > 0, a tie where update == 0
 *   m        = fma(w, g - m, m), w = 1 - b2    m.lerp_(g, w), whose formula for w < 0.5
 *            = fma(w - 1, g - m, g)                             and for w >= 0.5
 *   x        = x * keep -+ lr                  x.mul_(1 - lr * wd).add_(+-1, alpha=-lr)
 * distlion/kernels/__init__.py compares both against those ops on this machine before it lets them run, so a
 * machine whose torch rounds otherwise keeps the eager ops. Built with -ffp-contract=off: no fma but the ones
 * written here.
 *
 * Signs are packed little-endian within a byte (element 8k + j is bit j of byte k), as distlion.comm.packing.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

typedef struct {
    const float *grad;
    float *momentum;
    uint8_t *signs;
    float *x;
    const uint8_t *vote;
    float beta1, one_minus_beta1, one_minus_beta2, keep, lr;
    unsigned tie;
    int64_t begin, end, zeros;
} Job;

static void *rule_job(void *arg) {
    Job *job = arg;
    const float *g = job->grad;
    float *m = job->momentum, w = job->one_minus_beta2;
    int small = fabsf(w) < 0.5f;
    int64_t zeros = 0;
    for (int64_t k = job->begin / 8; k < (job->end + 7) / 8; k++) {
        int64_t start = 8 * k, count = job->end - start < 8 ? job->end - start : 8;
        unsigned positive = 0, zero = 0;
        for (int64_t i = 0; i < count; i++) {
            float gi = g[start + i], mi = m[start + i];
            float update = fmaf(gi, job->one_minus_beta1, mi * job->beta1);
            positive |= (unsigned)(update > 0.0f) << i;
            zero |= (unsigned)(update == 0.0f) << i;
            m[start + i] = small ? fmaf(w, gi - mi, mi) : fmaf(w - 1.0f, gi - mi, gi);
        }
        zeros += __builtin_popcount(zero);
        job->signs[k] = (uint8_t)(positive | (zero & job->tie));
    }
    job->zeros = zeros;
    return 0;
}

static void *apply_job(void *arg) {
    Job *job = arg;
    float *x = job->x;
    for (int64_t k = job->begin / 8; k < (job->end + 7) / 8; k++) {
        int64_t start = 8 * k, count = job->end - start < 8 ? job->end - start : 8;
        unsigned vote = job->vote[k];
        for (int64_t i = 0; i < count; i++) {
            float step = (vote >> i) & 1 ? -job->lr : job->lr;
            x[start + i] = x[start + i] * job->keep + step;
        }
    }
    return 0;
}

/* Runs `fn` over [0, n) in `threads` ranges of whole 64-element words (so no two threads write one byte);
 * one thread below 64k elements per thread, where starting threads costs more than it saves. */
static int64_t run(void *(*fn)(void *), Job job, int64_t n, int threads) {
    enum { MAX_THREADS = 64, MIN_PER_THREAD = 1 << 16 };
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1 || n < (int64_t)MIN_PER_THREAD * threads) threads = 1;
    int64_t words = (n + 63) / 64, zeros = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = job;
        jobs[t].begin = 64 * (words * t / threads);
        jobs[t].end = t + 1 == threads ? n : 64 * (words * (t + 1) / threads);
        /* the last range runs on this thread, and so does any whose thread could not start */
        started[t] = t + 1 < threads && pthread_create(&ids[t], 0, fn, &jobs[t]) == 0;
        if (!started[t]) fn(&jobs[t]);
    }
    for (int t = 0; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], 0);
        zeros += jobs[t].zeros;
    }
    return zeros;
}

/* The worker rule on n elements: signs (ceil(n / 8) bytes) written, momentum updated in place; a tie takes the
 * bit of `tie` at its position. Returns the number of ties. */
int64_t dlion_rule(const float *grad, float *momentum, uint8_t *signs, int64_t n, float beta1,
                   float one_minus_beta1, float one_minus_beta2, unsigned tie, int threads) {
    Job job = {.grad = grad, .momentum = momentum, .signs = signs, .beta1 = beta1,
               .one_minus_beta1 = one_minus_beta1, .one_minus_beta2 = one_minus_beta2, .tie = tie};
    return run(rule_job, job, n, threads);
}

/* The MaVo apply on n elements: x = x * keep - lr where the vote's bit is 1, x * keep + lr where it is 0. */
void dlion_apply(float *x, const uint8_t *vote, int64_t n, float keep, float lr, int threads) {
    Job job = {.x = x, .vote = vote, .keep = keep, .lr = lr};
    run(apply_job, job, n, threads);
}
