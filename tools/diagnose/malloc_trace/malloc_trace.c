/* A malloc log by call site, for finding which allocations keep glibc's heap from reusing
 * its holes (docs/stage3-memory.md, "The heap's holes: torch's flight recorder").
 *
 * Build:  gcc -O2 -shared -fPIC -o /tmp/malloc_trace.so tools/malloc_trace/malloc_trace.c -ldl -lpthread
 * A child forked without exec writes into its parent's log (interleaved lines): trace
 * processes that fork only to exec.
 * Use:    LD_PRELOAD=/tmp/malloc_trace.so MALLOC_TRACE_ALL=1 MALLOC_TRACE_OUT=/tmp/trace python ...
 *         (for one rank only: see heap_holes.py). The process may call
 *         ctypes.CDLL(None).malloc_trace_mark(b"phase name") to start logging (without
 *         MALLOC_TRACE_ALL) and to mark phases.
 *
 * Log (one file per process, MALLOC_TRACE_OUT.<pid>), one line per event:
 *   M <text>                          a mark
 *   B <hash> <depth>  + depth lines   a backtrace, the first time its hash is seen
 *   + <ptr> <size> <hash> <tid>       an allocation (realloc logs a free and an allocation)
 *   - <ptr>                           a free
 * Backtraces are taken for blocks >= 1 KiB, and for all sizes 24-160 bytes once a phase
 * has been marked (the start-up's imports would take minutes otherwise).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static void *(*real_memalign)(size_t, size_t);

static int fd = -1;
static volatile int enabled = 0, marked = 0;
static __thread int inside = 0;                  /* backtrace() may allocate */
static _Alignas(16) char bootstrap[8192];        /* dlsym's calloc, before calloc is found */
static size_t bootstrap_used = 0;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
#define SEEN_SLOTS 65536
static uint64_t seen[SEEN_SLOTS];

static __thread int resolving = 0;               /* inside dlsym: calloc from bootstrap */

static void find_real(void) {
  if (real_malloc) return;
  resolving = 1;
  real_calloc = dlsym(RTLD_NEXT, "calloc");
  real_free = dlsym(RTLD_NEXT, "free");
  real_realloc = dlsym(RTLD_NEXT, "realloc");
  real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
  real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
  real_memalign = dlsym(RTLD_NEXT, "memalign");
  real_malloc = dlsym(RTLD_NEXT, "malloc");     /* last: the others are set when it is */
  resolving = 0;
}

static void emit(const char *s, int n) {
  if (fd >= 0 && write(fd, s, n) < 0) fd = -1;
}

static void record(char op, void *p, size_t size) {
  if (!enabled || inside || fd < 0) return;
  inside = 1;
  char line[256];
  if (op == '-') {
    int n = snprintf(line, sizeof line, "- %lx\n", (unsigned long)p);
    pthread_mutex_lock(&lock); emit(line, n); pthread_mutex_unlock(&lock);
    inside = 0;
    return;
  }
  void *bt[14];
  int depth = (size >= 1024 || (marked && size >= 24 && size <= 160)) ? backtrace(bt, 14) : 2;
  uint64_t h = 1469598103934665603ULL;             /* FNV-1a over the return addresses */
  for (int i = 2; i < depth; i++) { h ^= (uint64_t)bt[i]; h *= 1099511628211ULL; }
  pthread_mutex_lock(&lock);
  uint64_t slot = h % SEEN_SLOTS;
  int probes = 0;
  while (seen[slot] && seen[slot] != h && ++probes < SEEN_SLOTS) slot = (slot + 1) % SEEN_SLOTS;
  if (!seen[slot]) {  /* a full table: the site's backtrace is not written, its hash is */
    seen[slot] = h;
    int n = snprintf(line, sizeof line, "B %lx %d\n", (unsigned long)h, depth - 2);
    emit(line, n);
    if (fd >= 0) backtrace_symbols_fd(bt + 2, depth - 2, fd);
  }
  int n = snprintf(line, sizeof line, "%c %lx %zu %lx %ld\n", op, (unsigned long)p, size,
                   (unsigned long)h, (long)syscall(SYS_gettid));
  emit(line, n);
  pthread_mutex_unlock(&lock);
  inside = 0;
}

void malloc_trace_mark(const char *text) {
  if (fd < 0) {
    const char *out = getenv("MALLOC_TRACE_OUT");
    char path[512];
    snprintf(path, sizeof path, "%s.%d", out ? out : "/tmp/malloc_trace", getpid());
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    void *bt[2];
    backtrace(bt, 2);  /* loads libgcc now, not inside a logged call */
  }
  enabled = 1;
  if (strcmp(text, "start")) marked = 1;
  char line[256];
  int n = snprintf(line, sizeof line, "M %s\n", text);
  pthread_mutex_lock(&lock); emit(line, n); pthread_mutex_unlock(&lock);
}

__attribute__((constructor)) static void start_at_load(void) {
  if (getenv("MALLOC_TRACE_ALL")) malloc_trace_mark("start");
}

void *malloc(size_t size) { find_real(); void *p = real_malloc(size); record('+', p, size); return p; }

void free(void *p) {
  if ((char *)p >= bootstrap && (char *)p < bootstrap + sizeof bootstrap) return;
  find_real();
  if (p) record('-', p, 0);
  real_free(p);
}

void *calloc(size_t count, size_t size) {
  if (!real_calloc) {
    if (!resolving) find_real();
    if (!real_calloc) {  /* dlsym itself asks for memory before calloc is known */
      size_t need = (count * size + 15) & ~(size_t)15;
      if (bootstrap_used + need > sizeof bootstrap) return NULL;
      void *p = bootstrap + bootstrap_used;
      bootstrap_used += need;
      return p;
    }
  }
  void *p = real_calloc(count, size);
  record('+', p, count * size);
  return p;
}

void *realloc(void *p, size_t size) {
  find_real();
  void *q = real_realloc(p, size);
  if (q || size == 0) {  /* a failed realloc leaves p as it was */
    if (p) record('-', p, 0);
    if (q) record('+', q, size);
  }
  return q;
}

int posix_memalign(void **out, size_t alignment, size_t size) {
  find_real();
  int error = real_posix_memalign(out, alignment, size);
  if (!error) record('+', *out, size);
  return error;
}

void *aligned_alloc(size_t alignment, size_t size) {
  find_real(); void *p = real_aligned_alloc(alignment, size); record('+', p, size); return p;
}

void *memalign(size_t alignment, size_t size) {
  find_real(); void *p = real_memalign(alignment, size); record('+', p, size); return p;
}
