/*
 * A stand-in for cuFile, for testing Ferry's GDS backend without a GPU: it exports the
 * cuFile entry points the backend loads, with cufile.h's struct layouts (asserted below
 * against the numbers in backends/gds/src/cufile.rs), and moves bytes with pread/pwrite
 * between files and host memory. Test knobs (not part of cuFile) start with standin_.
 *
 * Built by tests/standin.rs with: cc -shared -fPIC -O1 -o libcufile_standin.so <this> -lpthread
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct { unsigned err; unsigned cu_err; } CUfileError_t;
typedef struct {
  unsigned type;
  union { int fd; void *handle; } handle;
  const void *fs_ops;
} CUfileDescr_t;
typedef void *CUfileHandle_t;
typedef void *CUfileBatchHandle_t;
typedef struct {
  unsigned mode;
  union {
    struct { void *devPtr_base; int64_t file_offset; int64_t devPtr_offset; size_t size; } batch;
  } u;
  CUfileHandle_t fh;
  unsigned opcode;
  void *cookie;
} CUfileIOParams_t;
typedef struct { void *cookie; unsigned status; size_t ret; } CUfileIOEvents_t;
typedef struct {
  struct {
    unsigned major_version, minor_version;
    size_t poll_thresh_size, max_direct_io_size;
    unsigned dstatusflags, dcontrolflags;
  } nvfs;
  unsigned fflags, max_device_cache_size, per_buffer_cache_size, max_device_pinned_mem_size;
  unsigned max_batch_io_size, max_batch_io_timeout_msecs;
} CUfileDrvProps_t;

_Static_assert(sizeof(CUfileError_t) == 8, "CUfileError_t");
_Static_assert(sizeof(CUfileDescr_t) == 24, "CUfileDescr_t");
_Static_assert(offsetof(CUfileDescr_t, handle) == 8, "CUfileDescr_t.handle");
_Static_assert(offsetof(CUfileDescr_t, fs_ops) == 16, "CUfileDescr_t.fs_ops");
_Static_assert(sizeof(CUfileIOParams_t) == 64, "CUfileIOParams_t");
_Static_assert(offsetof(CUfileIOParams_t, u) == 8, "CUfileIOParams_t.u");
_Static_assert(offsetof(CUfileIOParams_t, fh) == 40, "CUfileIOParams_t.fh");
_Static_assert(offsetof(CUfileIOParams_t, opcode) == 48, "CUfileIOParams_t.opcode");
_Static_assert(offsetof(CUfileIOParams_t, cookie) == 56, "CUfileIOParams_t.cookie");
_Static_assert(sizeof(CUfileIOEvents_t) == 24, "CUfileIOEvents_t");
_Static_assert(offsetof(CUfileIOEvents_t, status) == 8, "CUfileIOEvents_t.status");
_Static_assert(offsetof(CUfileIOEvents_t, ret) == 16, "CUfileIOEvents_t.ret");
_Static_assert(sizeof(CUfileDrvProps_t) == 56, "CUfileDrvProps_t");
_Static_assert(offsetof(CUfileDrvProps_t, max_batch_io_size) == 48, "max_batch_io_size");

enum {
  OK = 0, NOT_INITIALIZED = 5001, INVALID_FILE_TYPE = 5018, INVALID_VALUE = 5022,
  ALREADY_REGISTERED = 5023, NOT_REGISTERED = 5024, HANDLE_NOT_REGISTERED = 5027,
};
enum { WAITING = 1, PENDING = 2, COMPLETE = 16, FAILED = 64 };
#define MAX_BATCH 256
#define MAX_BUFS 1024

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t released = PTHREAD_COND_INITIALIZER;
static int opened;
static int handles;
static int batches;
static struct { uintptr_t base; size_t len; } bufs[MAX_BUFS];
static int nbufs;
static size_t max_io;      /* 0 = unlimited: cap on bytes per read/write call */
static bool held;          /* I/O waits while set */
static unsigned long ios;  /* read/write calls made */
static bool fail_status;   /* cuFileBatchIOGetStatus fails while set */
static int refuse_batches; /* 1: set-up, 2: submit, 3: status refuse with BATCH_NOCOMPAT */

struct handle { int fd; };
struct event { void *cookie; unsigned status; size_t ret; };
struct batch {
  unsigned cap, n, reported;
  bool busy;
  CUfileIOParams_t *parked; /* submitted while held: run at the first free poll */
  struct event events[MAX_BATCH];
};

static CUfileError_t status(unsigned err) { CUfileError_t e = {err, 0}; return e; }

/* ---- test knobs */
void standin_set_max_io(size_t bytes) { pthread_mutex_lock(&lock); max_io = bytes; pthread_mutex_unlock(&lock); }
void standin_hold(int on) {
  pthread_mutex_lock(&lock);
  held = on != 0;
  if (!held) pthread_cond_broadcast(&released);
  pthread_mutex_unlock(&lock);
}
void standin_fail_status(int on) { pthread_mutex_lock(&lock); fail_status = on != 0; pthread_mutex_unlock(&lock); }
void standin_refuse_batches(int where) { pthread_mutex_lock(&lock); refuse_batches = where; pthread_mutex_unlock(&lock); }
static int refusing(void) { pthread_mutex_lock(&lock); int r = refuse_batches; pthread_mutex_unlock(&lock); return r; }
void standin_counts(int *out_handles, int *out_bufs, int *out_batches, unsigned long *out_ios) {
  pthread_mutex_lock(&lock);
  *out_handles = handles; *out_bufs = nbufs; *out_batches = batches; *out_ios = ios;
  pthread_mutex_unlock(&lock);
}

static void wait_while_held(void) {
  pthread_mutex_lock(&lock);
  while (held) pthread_cond_wait(&released, &lock);
  ios++;
  pthread_mutex_unlock(&lock);
}

static size_t cap(size_t size) {
  pthread_mutex_lock(&lock);
  size_t m = max_io;
  pthread_mutex_unlock(&lock);
  return (m && size > m) ? m : size;
}

/* ---- driver */
/* Built with -DSTANDIN_OPEN_BLOCKS, cuFileDriverOpen waits until standin_release_open()
 * is called: a cuFile whose driver open does not return (as a real one without a GPU). */
static int open_calls;
static bool open_released;
static pthread_cond_t open_release = PTHREAD_COND_INITIALIZER;
void standin_release_open(void) {
  pthread_mutex_lock(&lock);
  open_released = true;
  pthread_cond_broadcast(&open_release);
  pthread_mutex_unlock(&lock);
}
int standin_open_calls(void) {
  pthread_mutex_lock(&lock);
  int n = open_calls;
  pthread_mutex_unlock(&lock);
  return n;
}
CUfileError_t cuFileDriverOpen(void) {
  pthread_mutex_lock(&lock);
  open_calls++;
#ifdef STANDIN_OPEN_BLOCKS
  while (!open_released) pthread_cond_wait(&open_release, &lock);
#endif
  opened++;
  pthread_mutex_unlock(&lock);
  return status(OK);
}
CUfileError_t cuFileDriverClose(void) { return status(OK); }
CUfileError_t cuFileDriverGetProperties(CUfileDrvProps_t *props) {
  if (!opened) return status(NOT_INITIALIZED);
  memset(props, 0, sizeof *props);
  props->nvfs.dcontrolflags = 1u << 1; /* compat mode allowed; no nvidia-fs */
  props->max_batch_io_size = MAX_BATCH;
  return status(OK);
}
long cuFileUseCount(void) { pthread_mutex_lock(&lock); long n = handles; pthread_mutex_unlock(&lock); return n; }

/* ---- files */
CUfileError_t cuFileHandleRegister(CUfileHandle_t *fh, CUfileDescr_t *descr) {
  if (!opened) return status(NOT_INITIALIZED);
  if (!fh || !descr || descr->type != 1 || descr->fs_ops) return status(INVALID_VALUE);
  if (fcntl(descr->handle.fd, F_GETFL) < 0) return status(INVALID_FILE_TYPE);
  struct handle *h = malloc(sizeof *h);
  h->fd = descr->handle.fd;
  pthread_mutex_lock(&lock); handles++; pthread_mutex_unlock(&lock);
  *fh = h;
  return status(OK);
}
void cuFileHandleDeregister(CUfileHandle_t fh) {
  if (!fh) return;
  free(fh);
  pthread_mutex_lock(&lock); handles--; pthread_mutex_unlock(&lock);
}

/* ---- buffers */
static int find_buf(uintptr_t base) {
  for (int i = 0; i < nbufs; i++) if (bufs[i].base == base) return i;
  return -1;
}
CUfileError_t cuFileBufRegister(const void *base, size_t len, int flags) {
  (void)flags;
  if (!base || !len) return status(INVALID_VALUE);
  pthread_mutex_lock(&lock);
  unsigned err = OK;
  if (find_buf((uintptr_t)base) >= 0) err = ALREADY_REGISTERED;
  else if (nbufs == MAX_BUFS) err = INVALID_VALUE;
  else { bufs[nbufs].base = (uintptr_t)base; bufs[nbufs].len = len; nbufs++; }
  pthread_mutex_unlock(&lock);
  return status(err);
}
CUfileError_t cuFileBufDeregister(const void *base) {
  pthread_mutex_lock(&lock);
  int i = find_buf((uintptr_t)base);
  if (i >= 0) bufs[i] = bufs[--nbufs];
  pthread_mutex_unlock(&lock);
  return status(i >= 0 ? OK : NOT_REGISTERED);
}

/* A registered base must cover base+offset+size; an unregistered one is taken as is. */
static char *address(void *base, int64_t offset, size_t size) {
  pthread_mutex_lock(&lock);
  int i = find_buf((uintptr_t)base);
  bool ok = offset >= 0 && (i < 0 || (size_t)offset + size <= bufs[i].len);
  pthread_mutex_unlock(&lock);
  return ok ? (char *)base + offset : NULL;
}

static ssize_t io(CUfileHandle_t fh, void *base, size_t size, int64_t file_offset, int64_t buf_offset, bool write) {
  if (!fh) return -HANDLE_NOT_REGISTERED;
  char *p = address(base, buf_offset, size);
  if (!p || file_offset < 0) return -INVALID_VALUE;
  wait_while_held();
  int fd = ((struct handle *)fh)->fd;
  size = cap(size);
  return write ? pwrite(fd, p, size, file_offset) : pread(fd, p, size, file_offset);
}
ssize_t cuFileRead(CUfileHandle_t fh, void *base, size_t size, int64_t file_offset, int64_t buf_offset) {
  return io(fh, base, size, file_offset, buf_offset, false);
}
ssize_t cuFileWrite(CUfileHandle_t fh, const void *base, size_t size, int64_t file_offset, int64_t buf_offset) {
  return io(fh, (void *)base, size, file_offset, buf_offset, true);
}

/* ---- batches: the I/O runs at submit (or, while held, at the first poll after the
 * release); each poll reports at most two entries, so the caller has to come back. */
CUfileError_t cuFileBatchIOSetUp(CUfileBatchHandle_t *out, unsigned nr) {
  if (!opened) return status(NOT_INITIALIZED);
  if (!out || nr == 0 || nr > MAX_BATCH) return status(INVALID_VALUE);
  if (refusing() == 1) return status(5049); /* CU_FILE_BATCH_NOCOMPAT_ERROR */
  struct batch *b = calloc(1, sizeof *b);
  b->cap = nr;
  pthread_mutex_lock(&lock); batches++; pthread_mutex_unlock(&lock);
  *out = b;
  return status(OK);
}
CUfileError_t cuFileBatchIOSubmit(CUfileBatchHandle_t bh, unsigned nr, CUfileIOParams_t *params, unsigned flags) {
  (void)flags;
  struct batch *b = bh;
  if (!b || !params || nr == 0 || nr > b->cap || b->busy) return status(INVALID_VALUE);
  if (refusing() == 2) return status(5049);
  for (unsigned i = 0; i < nr; i++) {
    CUfileIOParams_t *p = &params[i];
    if (p->mode != 1 || p->opcode > 1) return status(INVALID_VALUE);
  }
  b->busy = true; b->n = nr; b->reported = 0;
  for (unsigned i = 0; i < nr; i++) {
    CUfileIOParams_t *p = &params[i];
    b->events[i].cookie = p->cookie;
    b->events[i].status = PENDING;
    b->events[i].ret = 0;
  }
  /* Keep a copy of the parameters, as cuFile does at submit. */
  CUfileIOParams_t *copy = malloc(nr * sizeof *copy);
  memcpy(copy, params, nr * sizeof *copy);
  pthread_mutex_lock(&lock);
  bool hold = held;
  pthread_mutex_unlock(&lock);
  if (!hold) {
    for (unsigned i = 0; i < nr; i++) {
      CUfileIOParams_t *p = &copy[i];
      ssize_t r = io(p->fh, p->u.batch.devPtr_base, p->u.batch.size, p->u.batch.file_offset,
                     p->u.batch.devPtr_offset, p->opcode == 1);
      b->events[i].status = r >= 0 ? COMPLETE : FAILED;
      b->events[i].ret = r >= 0 ? (size_t)r : (size_t)(r == -1 ? -(ssize_t)errno : r);
    }
    free(copy);
  } else {
    b->parked = copy;
  }
  return status(OK);
}
CUfileError_t cuFileBatchIOGetStatus(CUfileBatchHandle_t bh, unsigned min_nr, unsigned *nr, CUfileIOEvents_t *events, struct timespec *timeout) {
  (void)min_nr; (void)timeout;
  struct batch *b = bh;
  if (!b || !nr || !events) return status(INVALID_VALUE);
  pthread_mutex_lock(&lock);
  bool fail = fail_status;
  pthread_mutex_unlock(&lock);
  if (fail) return status(5030); /* CU_FILE_INTERNAL_ERROR */
  if (refusing() == 3 && b->busy) return status(5049);
  if (!b->busy) { *nr = 0; return status(OK); }
  if (b->parked) {
    pthread_mutex_lock(&lock);
    bool hold = held;
    pthread_mutex_unlock(&lock);
    if (hold) { *nr = 0; return status(OK); }
    CUfileIOParams_t *copy = b->parked;
    for (unsigned i = 0; i < b->n; i++) {
      CUfileIOParams_t *p = &copy[i];
      ssize_t r = io(p->fh, p->u.batch.devPtr_base, p->u.batch.size, p->u.batch.file_offset,
                     p->u.batch.devPtr_offset, p->opcode == 1);
      b->events[i].status = r >= 0 ? COMPLETE : FAILED;
      b->events[i].ret = r >= 0 ? (size_t)r : (size_t)(r == -1 ? -(ssize_t)errno : r);
    }
    free(copy);
    b->parked = NULL;
  }
  unsigned max = *nr, out = 0;
  if (max > 2) max = 2;
  while (out < max && b->reported < b->n) {
    struct event *e = &b->events[b->reported++];
    events[out].cookie = e->cookie;
    events[out].status = e->status;
    events[out].ret = e->ret;
    out++;
  }
  *nr = out;
  if (b->reported == b->n) b->busy = false;
  return status(OK);
}
CUfileError_t cuFileBatchIOCancel(CUfileBatchHandle_t bh) {
  struct batch *b = bh;
  if (!b) return status(INVALID_VALUE);
  free(b->parked); /* never started */
  b->parked = NULL;
  b->busy = false;
  return status(OK);
}
void cuFileBatchIODestroy(CUfileBatchHandle_t bh) {
  if (!bh) return;
  free(bh);
  pthread_mutex_lock(&lock); batches--; pthread_mutex_unlock(&lock);
}
