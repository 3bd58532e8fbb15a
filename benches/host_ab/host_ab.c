/*
 * A/B benchmark of the host copy engine: several builds of libmori_tp, loaded side by side, and a
 * plain C loop with one memcpy per row, on the same requests, interleaved.
 *
 *   host_ab [--rounds N] [--reps N] [--cold | --warm] [--head B] [--offset B] [--case NAME]...
 *           LABEL=PATH.so...
 *
 * Every library is opened by path with RTLD_LOCAL, so two builds of the same C API live in one
 * process. A case is one request (4096 tokens, pages of 16, fragmented page lists, 16 buffers,
 * 8 KV heads of 256 bytes unless --head says otherwise) on one rank pair; each library's result is
 * checked byte for byte against the loop's before it is timed. A round times every implementation `reps` times, rotating which goes first, and
 * prints medians and ratios within that round only: the machine is shared, so only ratios
 * measured side by side mean anything. benches/host_ab/run.sh builds the libraries and runs this.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../include/mori_tp.h"

#define TOKENS 4096
#define PAGE 16
#define BUFFERS 16
#define HEADS 8
#define MAX_IMPLS 8
#define MAX_REPS 99
/* Read before every cold call, so that it finds none of its data in the caches (L3: 32 MiB). */
#define EVICT_BYTES (96u << 20)

typedef MoriStatus (*slice_config_fn)(const MoriTpSliceParams *, MoriTpSliceConfig *);
typedef MoriStatus (*send_fn)(const MoriTpSliceConfig *, const MoriKvBuffers *, const int32_t *,
                              const int32_t *, size_t, const MoriSendOptions *);
typedef MoriStatus (*pack_fn)(const MoriTpSliceConfig *, const void *const *, size_t, uint64_t,
                              const int32_t *, size_t, void *, uint64_t, const MoriSendOptions *);
typedef MoriStatus (*unpack_fn)(const MoriTpSliceConfig *, const void *, uint64_t, void *const *,
                                size_t, uint64_t, const int32_t *, size_t,
                                const MoriSendOptions *);

/* One build of the library; pack and unpack are NULL in builds that predate them. */
struct lib {
  const char *label;
  slice_config_fn slice_config;
  send_fn send;
  pack_fn pack;
  unpack_fn unpack;
};

enum kind { SEND, PACK, UNPACK };

/* One request shape: prefill rank 1 (0 at TP 1) and its first decode partner, 8 KV heads. */
struct shape {
  const char *name;
  enum kind kind;
  uint32_t prefill_tp, decode_tp;
};

/* Rows of one head (256 B with --head 256) out of two, two heads out of four, four of eight. */
static const struct shape SHAPES[] = {
    {"strided_src_4to8", SEND, 4, 8}, /* rows out of source tokens twice as wide */
    {"strided_src_2to4", SEND, 2, 4},
    {"strided_src_1to2", SEND, 1, 2},
    {"strided_dst_8to4", SEND, 8, 4}, /* rows into destination tokens twice as wide */
    {"strided_dst_4to2", SEND, 4, 2},
    {"strided_dst_2to1", SEND, 2, 1},
    {"whole_token_4to4", SEND, 4, 4}, /* whole tokens: one block per run of pages */
    {"pack_4to8", PACK, 4, 8},        /* the strided source side into a staging region */
    {"unpack_8to4", UNPACK, 8, 4},    /* a staging region into the strided destination side */
};
#define NUM_SHAPES (sizeof SHAPES / sizeof SHAPES[0])

static void die(const char *what) {
  fprintf(stderr, "host_ab: %s\n", what);
  exit(1);
}

static void *checked_malloc(size_t n) {
  void *p = malloc(n);
  if (!p) die("out of memory");
  return p;
}

/*
 * Bytes past a page boundary at which every buffer starts (--offset). 0 by default: serving
 * engines allocate KV caches and staging regions page-aligned, or at least 256-byte aligned.
 */
static size_t base_offset;

/* Bytes of one KV head (--head): 256 for 128 bf16 elements, as Llama's and Qwen's. */
static uint64_t head_bytes = 256;

/* `n` bytes at `base_offset` past a page boundary; free with free_region. */
static uint8_t *region(size_t n) {
  uint8_t *p = aligned_alloc(4096, (n + base_offset + 4095) / 4096 * 4096);
  if (!p) die("out of memory");
  return p + base_offset;
}

static void free_region(uint8_t *p) { free(p - base_offset); }

static uint64_t splitmix(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Bytes that are not all alike, so no page is shared or zero-filled behind the benchmark's back. */
static void fill(uint8_t *p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(splitmix(&seed) >> 56);
}

/*
 * One side's page list for `pages` pages cut into `num_runs` runs: the runs in a shuffled order,
 * one or two free pages between them, as a paged allocator that has run a while hands them out.
 * Returns the capacity in pages.
 */
static int32_t lay_out(const int *runs, int num_runs, int32_t *pages, uint64_t *rng) {
  int order[TOKENS / PAGE], start[TOKENS / PAGE + 1];
  for (int r = 0; r < num_runs; r++) order[r] = r;
  for (int r = num_runs - 1; r > 0; r--) {
    int j = (int)(splitmix(rng) % (uint64_t)(r + 1)), t = order[r];
    order[r] = order[j];
    order[j] = t;
  }
  start[0] = 0;
  for (int r = 1; r <= num_runs; r++) start[r] = start[r - 1] + runs[r - 1];
  int32_t next = 0;
  for (int i = 0; i < num_runs; i++) {
    int r = order[i];
    for (int k = 0; k < runs[r]; k++) pages[start[r] + k] = next + k;
    next += runs[r] + 1 + (int32_t)(splitmix(rng) % 2);
  }
  return next;
}

/* Everything one case needs, the same for every implementation. */
struct request {
  const struct shape *shape;
  MoriTpSliceConfig config;
  int32_t src_pages[TOKENS / PAGE], dst_pages[TOKENS / PAGE];
  size_t pages;
  uint64_t src_capacity, dst_capacity, staging_len;
  uint8_t *src[BUFFERS], *dst[BUFFERS];
  uint8_t *want;   /* the loop's destination, every buffer back to back */
  uint64_t moved;  /* bytes per call */
};

static MoriTpSliceConfig config_for(const struct lib *lib, const struct shape *s) {
  uint32_t heads_p = HEADS / s->prefill_tp, heads_d = HEADS / s->decode_tp;
  uint32_t rank = s->prefill_tp > 1 ? 1 : 0;
  MoriTpSliceParams params = {
      .prefill_tp_size = s->prefill_tp,
      .prefill_tp_rank = rank,
      .decode_tp_size = s->decode_tp,
      /* the decode rank that holds the prefill rank's first head */
      .decode_tp_rank = rank * heads_p / heads_d,
      .total_kv_heads = HEADS,
      .page_size = PAGE,
      .src_item_len = (uint64_t)PAGE * heads_p * head_bytes,
      .dst_item_len = (uint64_t)PAGE * heads_d * head_bytes,
  };
  MoriTpSliceConfig config;
  if (lib->slice_config(&params, &config) != MORI_OK || config.action != MORI_TP_ACTION_SEND)
    die("mori_tp_slice_config did not give a SEND pair");
  return config;
}

/* The rows of one buffer, one memcpy each: what a caller without the library would write. */
static void loop_buffer(const struct request *q, const uint8_t *src, uint8_t *dst) {
  const MoriTpSliceConfig *c = &q->config;
  size_t width = c->heads_bytes_per_token_to_send, k = 0;
  for (size_t i = 0; i < q->pages; i++) {
    for (size_t t = 0; t < PAGE; t++, k++) {
      size_t s = (size_t)q->src_pages[i] * c->src_item_len + t * c->bytes_per_token_src +
                 c->src_head_slice_offset;
      size_t d = (size_t)q->dst_pages[i] * c->dst_item_len + t * c->bytes_per_token_dst +
                 c->dst_head_slice_offset;
      /* a pack reads pages and writes the region; an unpack the reverse */
      if (q->shape->kind == PACK) d = k * width;
      if (q->shape->kind == UNPACK) s = k * width;
      memcpy(dst + d, src + s, width);
    }
  }
}

static void run_loop(const struct request *q) {
  for (int b = 0; b < BUFFERS; b++) loop_buffer(q, q->src[b], q->dst[b]);
}

/* One call of `lib` on the request; 0 when that build lacks the entry point. */
static int run_lib(const struct lib *lib, const struct request *q) {
  MoriSendOptions host = {.backend = MORI_BACKEND_HOST, .flags = 0, .stream = NULL};
  const MoriTpSliceConfig *c = &q->config;
  MoriStatus status = MORI_OK;
  switch (q->shape->kind) {
    case SEND: {
      MoriKvBuffers buffers = {.src = (const void *const *)q->src,
                               .dst = (void *const *)q->dst,
                               .num_buffers = BUFFERS,
                               .src_capacity = q->src_capacity,
                               .dst_capacity = q->dst_capacity};
      status = lib->send(c, &buffers, q->src_pages, q->dst_pages, q->pages, &host);
      break;
    }
    case PACK:
      if (!lib->pack) return 0;
      /* the region is dst[0], BUFFERS * staging_len bytes */
      status = lib->pack(c, (const void *const *)q->src, BUFFERS, q->src_capacity,
                         q->src_pages, q->pages, q->dst[0], BUFFERS * q->staging_len, &host);
      break;
    case UNPACK:
      if (!lib->unpack) return 0;
      status = lib->unpack(c, q->src[0], BUFFERS * q->staging_len, (void *const *)q->dst,
                           BUFFERS, q->dst_capacity, q->dst_pages, q->pages, &host);
      break;
  }
  if (status != MORI_OK) die("a library call failed");
  return 1;
}

/*
 * The request of `shape`. A pack's destination and an unpack's source is one region, buffer b at
 * b * staging_len, so dst[b] (or src[b]) points into it.
 */
static void build(struct request *q, const struct shape *shape, const struct lib *lib) {
  memset(q, 0, sizeof *q);
  q->shape = shape;
  q->config = config_for(lib, shape);
  q->pages = TOKENS / PAGE;
  uint64_t rng = 23;
  int runs[TOKENS / PAGE], num_runs = 0;
  for (int left = (int)q->pages; left > 0; left -= runs[num_runs++]) {
    int len = 1 + (int)(splitmix(&rng) % 16); /* runs of 1-16 pages */
    runs[num_runs] = len < left ? len : left;
  }
  q->src_capacity = (uint64_t)lay_out(runs, num_runs, q->src_pages, &rng) * q->config.src_item_len;
  q->dst_capacity = (uint64_t)lay_out(runs, num_runs, q->dst_pages, &rng) * q->config.dst_item_len;
  q->staging_len = (uint64_t)TOKENS * q->config.heads_bytes_per_token_to_send;
  q->moved = BUFFERS * q->staging_len;
  uint64_t src_len = shape->kind == UNPACK ? q->staging_len : q->src_capacity;
  uint64_t dst_len = shape->kind == PACK ? q->staging_len : q->dst_capacity;
  uint8_t *src_region = region(BUFFERS * src_len);
  uint8_t *dst_region = region(BUFFERS * dst_len);
  fill(src_region, BUFFERS * src_len, 1);
  for (int b = 0; b < BUFFERS; b++) {
    q->src[b] = src_region + b * src_len;
    q->dst[b] = dst_region + b * dst_len;
  }
  /* The loop's result, from a destination of known bytes; each library must match it. */
  memset(dst_region, 0xEE, BUFFERS * dst_len);
  run_loop(q);
  q->want = checked_malloc(BUFFERS * dst_len);
  memcpy(q->want, dst_region, BUFFERS * dst_len);
}

static size_t dst_bytes(const struct request *q) {
  return BUFFERS * (q->shape->kind == PACK ? q->staging_len : q->dst_capacity);
}

static void release(struct request *q) {
  free_region(q->src[0]);
  free_region(q->dst[0]);
  free(q->want);
}

/* Whether `lib` writes exactly what the loop writes, and nothing else. */
static int matches(const struct lib *lib, struct request *q) {
  memset(q->dst[0], 0xEE, dst_bytes(q));
  if (!run_lib(lib, q)) return 1;
  return memcmp(q->dst[0], q->want, dst_bytes(q)) == 0;
}

/*
 * This thread's CPU time: a host copy never blocks, so it equals the wall time of a call that is
 * not preempted, and the other jobs on a shared machine's cores do not add their time slices.
 */
static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint8_t *evict_buffer;

/* Rounds (cold and warm each count) kept for the summary of each case. */
#define MAX_SAMPLES 256

/*
 * The ratios of every round, for the summary: per case, each library's loop time / its time,
 * and the last library's (this tree's, as run.sh orders them) against each earlier one.
 */
static double vs_loop[sizeof SHAPES / sizeof SHAPES[0]][MAX_IMPLS][MAX_SAMPLES];
static double vs_earlier[sizeof SHAPES / sizeof SHAPES[0]][MAX_IMPLS][MAX_SAMPLES];
static int num_vs_loop[sizeof SHAPES / sizeof SHAPES[0]][MAX_IMPLS];
static int num_vs_earlier[sizeof SHAPES / sizeof SHAPES[0]][MAX_IMPLS];
static unsigned row_bytes[sizeof SHAPES / sizeof SHAPES[0]];

/* Reads EVICT_BYTES, so that the caches hold clean lines of nothing the next call touches. */
static void evict(void) {
  volatile uint8_t sink;
  uint8_t sum = 0;
  for (size_t i = 0; i < EVICT_BYTES; i += 64) sum += evict_buffer[i];
  sink = sum;
  (void)sink;
}

static int compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, compare_doubles);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/*
 * One round of one case: `reps` times each implementation (index 0 is the loop, then the
 * libraries), the first of each repetition rotating, and the medians printed as ratios. Cold:
 * each timed call starts from caches that hold none of the request. Warm: each timed call right
 * after an untimed one of the same implementation, in the caches that call left behind (a
 * request whose bytes were just written, or a benchmark loop).
 */
static void round_of(size_t s, struct request *q, const struct lib *libs, int num_libs, int reps,
                     int round, int warm) {
  int n = num_libs + 1;
  double times[MAX_IMPLS + 1][MAX_REPS], med[MAX_IMPLS + 1];
  int has[MAX_IMPLS + 1];
  for (int rep = 0; rep < reps; rep++) {
    for (int k = 0; k < n; k++) {
      int i = (rep + k) % n;
      if (warm)
        has[i] = i == 0 ? (run_loop(q), 1) : run_lib(&libs[i - 1], q);
      else
        evict();
      double t0 = now_s();
      has[i] = i == 0 ? (run_loop(q), 1) : run_lib(&libs[i - 1], q);
      times[i][rep] = now_s() - t0;
    }
  }
  for (int i = 0; i < n; i++) med[i] = median(times[i], reps);
  printf("%-16s %4u B %s %d  loop %6.2f ms %5.1f GB/s", q->shape->name,
         (unsigned)q->config.heads_bytes_per_token_to_send, warm ? "warm" : "cold", round,
         med[0] * 1e3,
         (double)q->moved / med[0] * 1e-9);
  for (int i = 1; i < n; i++) {
    if (!has[i]) {
      printf(" | %s: n/a", libs[i - 1].label);
      continue;
    }
    printf(" | %s %6.2f ms, %.2fx loop", libs[i - 1].label, med[i] * 1e3, med[0] / med[i]);
    if (i > 1 && has[1]) printf(", %.2fx %s", med[1] / med[i], libs[0].label);
  }
  printf("\n");
  fflush(stdout);
  row_bytes[s] = (unsigned)q->config.heads_bytes_per_token_to_send;
  for (int i = 1; i < n; i++) {
    if (has[i] && num_vs_loop[s][i - 1] < MAX_SAMPLES)
      vs_loop[s][i - 1][num_vs_loop[s][i - 1]++] = med[0] / med[i];
    if (i < num_libs && has[i] && has[num_libs] && num_vs_earlier[s][i - 1] < MAX_SAMPLES)
      vs_earlier[s][i - 1][num_vs_earlier[s][i - 1]++] = med[i] / med[num_libs];
  }
}

/* "1.06 (0.99-1.15)": the median of a case's ratios over its rounds, then the lowest and
 * highest; "-" when none were measured (a library without that function). */
static void print_cell(double *v, int n) {
  if (n == 0) {
    printf(" - |");
    return;
  }
  double m = median(v, n); /* sorts v */
  printf(" %.2f (%.2f-%.2f) |", m, v[0], v[n - 1]);
}

/*
 * A Markdown table of every case measured: benches/regenerate pastes what follows the line
 * "== results ==" into BENCHMARKS.md.
 */
static void print_summary(const struct lib *libs, int num_libs, int rounds, int reps,
                          int cache_modes) {
  printf("\n== results ==\n\n");
  printf("%d tokens in runs of 1-%d pages of %d, %d buffers starting %zu B past a page, %d KV heads "
         "of %u B; each round times every implementation %d times (the first of each repetition "
         "rotating, thread CPU time) and takes the medians; %d rounds, each %s. A cell is the median "
         "over the rounds of the ratio within each round, then the lowest and highest round; "
         "\"A / B\" is B's time over A's (above 1: A is faster).\n\n",
         TOKENS, 16, PAGE, BUFFERS, base_offset, HEADS, (unsigned)head_bytes, reps, rounds,
         cache_modes == 2 ? "cold and warm" : cache_modes == 0 ? "cold" : "warm");
  printf("| case | rows |");
  for (int i = 0; i < num_libs; i++) printf(" %s / loop |", libs[i].label);
  for (int i = 0; i + 1 < num_libs; i++)
    printf(" %s / %s |", libs[num_libs - 1].label, libs[i].label);
  printf("\n|---|---:|");
  for (int i = 0; i < 2 * num_libs - 1; i++) printf("---:|");
  printf("\n");
  for (size_t s = 0; s < NUM_SHAPES; s++) {
    if (num_vs_loop[s][num_libs - 1] == 0) continue;
    printf("| %s | %u B |", SHAPES[s].name, row_bytes[s]);
    for (int i = 0; i < num_libs; i++) print_cell(vs_loop[s][i], num_vs_loop[s][i]);
    for (int i = 0; i + 1 < num_libs; i++) print_cell(vs_earlier[s][i], num_vs_earlier[s][i]);
    printf("\n");
  }
}

static void open_lib(struct lib *lib, char *arg) {
  char *eq = strchr(arg, '=');
  if (!eq) die("libraries are given as LABEL=PATH");
  *eq = 0;
  lib->label = arg;
  void *h = dlopen(eq + 1, RTLD_NOW | RTLD_LOCAL);
  if (!h) die(dlerror());
  lib->slice_config = (slice_config_fn)dlsym(h, "mori_tp_slice_config");
  lib->send = (send_fn)dlsym(h, "mori_send_kvcache");
  lib->pack = (pack_fn)dlsym(h, "mori_pack_kvcache");
  lib->unpack = (unpack_fn)dlsym(h, "mori_unpack_kvcache");
  if (!lib->slice_config || !lib->send) die("a library without mori_send_kvcache");
}

int main(int argc, char **argv) {
  struct lib libs[MAX_IMPLS];
  const char *only[NUM_SHAPES];
  int num_libs = 0, num_only = 0, rounds = 2, reps = 9;
  enum { BOTH, COLD, WARM } cache = BOTH;
  for (int a = 1; a < argc; a++) {
    if (!strcmp(argv[a], "--rounds") && a + 1 < argc) {
      rounds = atoi(argv[++a]);
    } else if (!strcmp(argv[a], "--reps") && a + 1 < argc) {
      reps = atoi(argv[++a]);
    } else if (!strcmp(argv[a], "--head") && a + 1 < argc) {
      head_bytes = (uint64_t)atoi(argv[++a]);
    } else if (!strcmp(argv[a], "--offset") && a + 1 < argc) {
      base_offset = (size_t)atoi(argv[++a]) % 4096;
    } else if (!strcmp(argv[a], "--cold")) {
      cache = COLD;
    } else if (!strcmp(argv[a], "--warm")) {
      cache = WARM;
    } else if (!strcmp(argv[a], "--case") && a + 1 < argc && num_only < (int)NUM_SHAPES) {
      only[num_only++] = argv[++a];
    } else if (num_libs < MAX_IMPLS) {
      open_lib(&libs[num_libs++], argv[a]);
    } else {
      die("too many libraries");
    }
  }
  if (num_libs == 0 || rounds < 1 || reps < 1 || reps > MAX_REPS || head_bytes == 0)
    die("usage: host_ab [--rounds N] [--reps 1-99] [--cold | --warm] [--head B] [--offset B] "
        "[--case NAME]... LABEL=PATH.so...");
  evict_buffer = checked_malloc(EVICT_BYTES);
  fill(evict_buffer, EVICT_BYTES, 3);
  printf("%d tokens, pages of %d (fragmented), %d buffers at %zu B past a page, %d KV heads of "
         "%u B; median of %d calls per round; Nx loop > 1: faster than the per-row memcpy loop\n",
         TOKENS, PAGE, BUFFERS, base_offset, HEADS, (unsigned)head_bytes, reps);
  struct request *q = checked_malloc(sizeof *q);
  for (int round = 1; round <= rounds; round++) {
    for (size_t s = 0; s < NUM_SHAPES; s++) {
      int wanted = num_only == 0;
      for (int i = 0; i < num_only; i++) wanted |= !strcmp(only[i], SHAPES[s].name);
      if (!wanted) continue;
      build(q, &SHAPES[s], &libs[0]);
      for (int i = 0; i < num_libs; i++) {
        MoriTpSliceConfig config = config_for(&libs[i], &SHAPES[s]);
        if (memcmp(&config, &q->config, sizeof config))
          die("the libraries disagree on the slice config");
        if (!matches(&libs[i], q)) {
          fprintf(stderr, "host_ab: %s: %s wrote other bytes than the loop\n", SHAPES[s].name,
                  libs[i].label);
          return 1;
        }
      }
      for (int warm = 0; warm < 2; warm++)
        if (warm ? cache != COLD : cache != WARM)
          round_of(s, q, libs, num_libs, reps, round, warm);
      release(q);
    }
  }
  print_summary(libs, num_libs, rounds, reps, cache == BOTH ? 2 : cache == WARM ? 1 : 0);
  free(q);
  free(evict_buffer);
  return 0;
}
