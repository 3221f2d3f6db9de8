/* kvbrokerd._tcpread: the tcp data port's reads served without Python (backends/tcp/server.py, wire.py).
 *
 * Every small READ used to cost the source daemon ~150 us of Python (a numpy parse and check of the runs, a pin, a
 * scatter/gather send) and a turn of the GIL: about one more gRPC ping on a 64 KiB pull. Here a connection's thread
 * calls ReadTable.serve(), which, with the GIL released, reads requests, checks each against the table of caches it
 * may serve and sends the runs' bytes straight from the caches' memory with sendmsg(), until a request needs Python
 * (a WRITE, an unknown or refused cache, a bad run, a read larger than the limits): serve() then returns that
 * request's bytes and Python answers it as before. Nothing a peer sends is trusted: the frame's size is bounded
 * before it is read, every run is checked against its cache's tensors, and every wait has a deadline.
 *
 * The table is Python's to keep (put() when a cache joins the registry, drop() when it leaves, after its last pin
 * and before its memory is unmapped): drop() waits until no native read uses the cache. A read of a cache being
 * dropped gives up as soon as the peer stops taking bytes. A cache whose memory vanishes under a send (its owner
 * truncated the segment) is EFAULT from the kernel, never a signal: the read is padded with zeros and its trailer
 * says how many leading bytes were the source's, as server.py does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define HEAD_BYTES 24 /* "KVRQ", u32 runs, i64 cache id, u32 deadline ms, u32 reserved */
#define RUN_BYTES 24  /* u32 tensor, u32 reserved, u64 offset, u64 length */
#define REPLY_BYTES 16 /* magic, u32 status, u64 bytes (the reply and the trailer alike) */
#define MAX_NATIVE_RUNS 1024
/* A cache being dropped: a send blocked this long re-checks whether it must give up. */
#define CLOSING_POLL_S 0.05

struct region {
    int64_t cache_id;
    uint32_t num_tensors;
    uint64_t tensor_nbytes;
    uint64_t *addresses;
    int users;   /* native reads sending from it (under the table's lock) */
    int dropped; /* left the table: its reads give up when the peer stops taking bytes */
};

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t released; /* a dropped region's last read ended */
    struct region **regions;
    Py_ssize_t count, capacity;
} ReadTable;

struct limits {
    double idle_s, request_s, stall_s, max_request_s, rate_bytes_per_s, rate_window_s;
    uint64_t max_bytes;
    uint32_t max_runs, not_exist_status;
};

enum outcome { SERVED, PEER_GONE, HAND_BACK, FAULTED, TIMED_OUT, ABORTED, BROKEN, OS_ERROR };

struct request {
    unsigned char frame[HEAD_BYTES + MAX_NATIVE_RUNS * RUN_BYTES];
    size_t frame_bytes;
    const char *why; /* TIMED_OUT / ABORTED / BROKEN */
    int error;       /* OS_ERROR */
    int64_t faulted_cache;
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t le64(const unsigned char *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }
static void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static void put64(unsigned char *p, uint64_t v) {
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}
static void frame_reply(unsigned char *p, const char *magic, uint32_t status, uint64_t bytes) {
    memcpy(p, magic, 4);
    put32(p + 4, status);
    put64(p + 8, bytes);
}

/* Waits up to `seconds` for `events`: 1 ready (or the socket failed: the next call says how), 0 timed out, -1
 * error (errno). */
static int wait_fd(int fd, short events, double seconds) {
    if (seconds <= 0)
        return 0;
    const int ms = seconds > 1e6 ? 1000000000 : (int)(seconds * 1e3) + 1;
    struct pollfd p = {fd, events, 0};
    for (;;) {
        const int r = poll(&p, 1, ms);
        if (r >= 0 || errno != EINTR)
            return r;
    }
}

/* Reads exactly n bytes before `deadline`. */
static enum outcome recv_exact(int fd, unsigned char *buf, size_t n, double deadline, struct request *rq) {
    size_t got = 0;
    while (got < n) {
        const ssize_t r = recv(fd, buf + got, n - got, MSG_DONTWAIT);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0) {
            rq->why = "peer closed the data connection mid-request";
            return BROKEN;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            rq->error = errno;
            return OS_ERROR;
        }
        const int w = wait_fd(fd, POLLIN, deadline - now_s());
        if (w < 0) {
            rq->error = errno;
            return OS_ERROR;
        }
        if (w == 0) {
            rq->why = "the request's frame did not arrive in time";
            return TIMED_OUT;
        }
    }
    return SERVED;
}

/* The bounds of one send: its deadline, the stall and rate rules, and the region whose drop ends it. */
struct watch {
    double deadline, progress_at, window_at;
    uint64_t window_bytes;
    const struct limits *limits;
    ReadTable *table;
    const struct region *region;
};

static int region_dropped(struct watch *w) {
    if (w->region == NULL)
        return 0;
    pthread_mutex_lock(&w->table->lock);
    const int dropped = w->region->dropped;
    pthread_mutex_unlock(&w->table->lock);
    return dropped;
}

/* 0 while the send may go on; else sets rq->why and returns the outcome that ends it. */
static enum outcome judge(struct watch *w, double now, struct request *rq) {
    const struct limits *l = w->limits;
    if (now >= w->deadline) {
        rq->why = "the request's deadline passed";
        return TIMED_OUT;
    }
    if (now >= w->progress_at + l->stall_s) {
        rq->why = "no progress for the stall timeout";
        return TIMED_OUT;
    }
    if (l->rate_bytes_per_s > 0 && now - w->window_at >= l->rate_window_s) {
        if ((double)w->window_bytes < l->rate_bytes_per_s * (now - w->window_at)) {
            rq->why = "the peer read below the minimum rate";
            return TIMED_OUT;
        }
        w->window_at = now;
        w->window_bytes = 0;
    }
    return SERVED;
}

/* Sends iov[0..n) in order (the array is consumed). *sent counts the bytes that left; EFAULT is FAULTED. */
static enum outcome send_views(int fd, struct iovec *iov, size_t n, struct watch *w, uint64_t *sent,
                               struct request *rq) {
    size_t i = 0;
    while (i < n && iov[i].iov_len == 0)
        i++;
    while (i < n) {
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov + i;
        msg.msg_iovlen = n - i < IOV_MAX ? n - i : IOV_MAX;
        const ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r > 0) {
            size_t done = (size_t)r;
            *sent += done;
            const double now = now_s();
            w->progress_at = now;
            w->window_bytes += done;
            while (i < n && done >= iov[i].iov_len)
                done -= iov[i++].iov_len;
            if (i < n) {
                iov[i].iov_base = (char *)iov[i].iov_base + done;
                iov[i].iov_len -= done;
            }
            while (i < n && iov[i].iov_len == 0)
                i++;
            /* Judged only while bytes remain: a reply sent whole is never taken back. */
            enum outcome o = i < n ? judge(w, now, rq) : SERVED;
            if (o != SERVED)
                return o;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EFAULT)
            return FAULTED;
        if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            rq->error = errno;
            return OS_ERROR;
        }
        double now = now_s();
        enum outcome o = judge(w, now, rq);
        if (o != SERVED)
            return o;
        double slice = w->deadline - now;
        if (w->progress_at + w->limits->stall_s - now < slice)
            slice = w->progress_at + w->limits->stall_s - now;
        if (w->limits->rate_bytes_per_s > 0 && w->window_at + w->limits->rate_window_s - now < slice)
            slice = w->window_at + w->limits->rate_window_s - now;
        if (w->region != NULL && slice > CLOSING_POLL_S)
            slice = CLOSING_POLL_S;
        const int ready = wait_fd(fd, POLLOUT, slice < 0.001 ? 0.001 : slice);
        if (ready < 0) {
            rq->error = errno;
            return OS_ERROR;
        }
        if (ready == 0 && region_dropped(w)) {
            rq->why = "its cache is being released and the peer stopped reading";
            return ABORTED;
        }
    }
    return SERVED;
}

static enum outcome send_zeros(int fd, uint64_t n, struct watch *w, struct request *rq) {
    static const char zeros[1 << 16];
    struct iovec iov[16];
    while (n) {
        size_t k = 0;
        for (; k < 16 && n; k++) {
            const uint64_t chunk = n < sizeof zeros ? n : sizeof zeros;
            iov[k].iov_base = (void *)zeros;
            iov[k].iov_len = (size_t)chunk;
            n -= chunk;
        }
        uint64_t sent = 0;
        enum outcome o = send_views(fd, iov, k, w, &sent, rq);
        if (o != SERVED)
            return o; /* zeros never fault */
    }
    return SERVED;
}

/* The region `cache_id` with one more user, or NULL when the table does not hold it. */
static struct region *use_region(ReadTable *t, int64_t cache_id) {
    struct region *found = NULL;
    pthread_mutex_lock(&t->lock);
    for (Py_ssize_t i = 0; i < t->count; i++) {
        if (t->regions[i]->cache_id == cache_id) {
            found = t->regions[i];
            found->users++;
            break;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return found;
}

static void leave_region(ReadTable *t, struct region *r) {
    pthread_mutex_lock(&t->lock);
    if (--r->users == 0 && r->dropped)
        pthread_cond_broadcast(&t->released);
    pthread_mutex_unlock(&t->lock);
}

/* Whether every run of the frame lies inside region r's tensors; *total gets the bytes they name. */
static int runs_fit(const struct region *r, const unsigned char *runs, uint32_t count, uint64_t *total) {
    uint64_t sum = 0;
    for (uint32_t i = 0; i < count; i++) {
        const unsigned char *run = runs + (size_t)i * RUN_BYTES;
        const uint32_t tensor = le32(run);
        const uint64_t offset = le64(run + 8), length = le64(run + 16);
        if (tensor >= r->num_tensors || length == 0 || length > r->tensor_nbytes ||
            offset > r->tensor_nbytes - length)
            return 0;
        sum += length; /* at most MAX_NATIVE_RUNS runs of at most a tensor each: no overflow */
    }
    *total = sum;
    return 1;
}

/* Sends the reply, the runs' bytes and the trailer of a checked READ (the caller holds the region). */
static enum outcome send_read(int fd, const struct region *r, const unsigned char *runs, uint32_t count,
                              uint64_t total, struct watch *w, struct request *rq) {
    unsigned char reply[REPLY_BYTES], trailer[REPLY_BYTES];
    frame_reply(reply, "KVRS", 0, total);
    frame_reply(trailer, "KVEN", 0, total);
    struct iovec iov[MAX_NATIVE_RUNS + 2];
    iov[0].iov_base = reply;
    iov[0].iov_len = REPLY_BYTES;
    for (uint32_t i = 0; i < count; i++) {
        const unsigned char *run = runs + (size_t)i * RUN_BYTES;
        iov[i + 1].iov_base = (void *)(uintptr_t)(r->addresses[le32(run)] + le64(run + 8));
        iov[i + 1].iov_len = (size_t)le64(run + 16);
    }
    iov[count + 1].iov_base = trailer;
    iov[count + 1].iov_len = REPLY_BYTES;
    uint64_t sent = 0;
    enum outcome o = send_views(fd, iov, count + 2, w, &sent, rq);
    if (o != FAULTED)
        return o;
    /* The source's memory vanished after `sent` bytes (the reply is ours and goes first): the rest of the reply,
     * zeros for the rest of the payload, and a trailer that says how much was the source's. */
    rq->faulted_cache = r->cache_id;
    w->region = NULL; /* what is left to send is ours */
    const uint64_t good = sent > REPLY_BYTES ? sent - REPLY_BYTES : 0;
    if (sent < REPLY_BYTES) {
        struct iovec rest = {reply + sent, REPLY_BYTES - (size_t)sent};
        uint64_t ignored = 0;
        if ((o = send_views(fd, &rest, 1, w, &ignored, rq)) != SERVED)
            return o;
    }
    if ((o = send_zeros(fd, total - good, w, rq)) != SERVED)
        return o;
    frame_reply(trailer, "KVEN", w->limits->not_exist_status, good);
    struct iovec end = {trailer, REPLY_BYTES};
    uint64_t ignored = 0;
    return (o = send_views(fd, &end, 1, w, &ignored, rq)) == SERVED ? FAULTED : o;
}

/* Reads the next request and serves it if it is a READ this table can answer (GIL released). */
static enum outcome serve_one(ReadTable *t, int fd, const struct limits *l, struct request *rq) {
    rq->frame_bytes = 0;
    const int ready = wait_fd(fd, POLLIN, l->idle_s);
    if (ready <= 0)
        return ready == 0 ? PEER_GONE : (rq->error = errno, OS_ERROR);
    const ssize_t peek = recv(fd, rq->frame, 1, MSG_PEEK | MSG_DONTWAIT);
    if (peek == 0)
        return PEER_GONE;
    const double frame_deadline = now_s() + l->request_s;
    enum outcome o = recv_exact(fd, rq->frame, HEAD_BYTES, frame_deadline, rq);
    if (o != SERVED)
        return o;
    rq->frame_bytes = HEAD_BYTES;
    const uint32_t count = le32(rq->frame + 4);
    if (memcmp(rq->frame, "KVRQ", 4) != 0 || count == 0 || count > l->max_runs)
        return HAND_BACK; /* Python reads the rest, or refuses the frame */
    if ((o = recv_exact(fd, rq->frame + HEAD_BYTES, (size_t)count * RUN_BYTES, frame_deadline, rq)) != SERVED)
        return o;
    rq->frame_bytes += (size_t)count * RUN_BYTES;
    const uint32_t budget_ms = le32(rq->frame + 16);
    const double budget = budget_ms && budget_ms / 1e3 < l->max_request_s ? budget_ms / 1e3 : l->max_request_s;
    struct region *r = use_region(t, (int64_t)le64(rq->frame + 8));
    if (r == NULL)
        return HAND_BACK; /* Python says why: unknown, closing, or not one served natively */
    uint64_t total = 0;
    if (!runs_fit(r, rq->frame + HEAD_BYTES, count, &total) || total > l->max_bytes) {
        leave_region(t, r);
        return HAND_BACK;
    }
    const double now = now_s();
    struct watch w = {now + budget, now, now, 0, l, t, r};
    o = send_read(fd, r, rq->frame + HEAD_BYTES, count, total, &w, rq);
    leave_region(t, r);
    return o;
}

PyDoc_STRVAR(serve_doc,
"serve(fd, idle_s, request_s, stall_s, max_request_s, rate_bytes_per_s, rate_window_s, max_bytes, max_runs,\n"
"      not_exist_status, /) -> bytes | int | None\n--\n\n"
"Serves the READs arriving on the (version 2, plain) data connection `fd` from this table's caches, with the GIL\n"
"released, until one needs Python. Returns None when the peer closed the connection or sent nothing for idle_s;\n"
"the bytes of a request it did not serve (its 24-byte head, and its runs when it read them) for Python to answer;\n"
"or the id of a cache whose memory vanished under a read (the read was padded with zeros and its trailer says so).\n"
"Raises TimeoutError (a frame slower than request_s, a send past its deadline, stalled for stall_s or below the\n"
"minimum rate), ConnectionAbortedError (its cache was dropped and the peer stopped reading), ConnectionError (the\n"
"peer left mid-request) or OSError: the connection must end. A READ is served here when its magic is KVRQ, it\n"
"has 1..max_runs runs (at most 1024), its cache is in the table and every run lies inside a tensor, and its bytes\n"
"are at most max_bytes; its deadline is the one it announces (at most max_request_s).");

static PyObject *table_serve(ReadTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "serve() takes 10 arguments, got %zd", nargs);
        return NULL;
    }
    struct limits l;
    const long fd_arg = PyLong_AsLong(args[0]);
    if (fd_arg == -1 && PyErr_Occurred())
        return NULL;
    const int fd = fd_arg < 0 || fd_arg > INT_MAX ? -1 : (int)fd_arg;
    double *doubles[6] = {&l.idle_s, &l.request_s, &l.stall_s, &l.max_request_s, &l.rate_bytes_per_s,
                          &l.rate_window_s};
    for (int i = 0; i < 6; i++) {
        *doubles[i] = PyFloat_AsDouble(args[1 + i]);
        if (*doubles[i] == -1.0 && PyErr_Occurred())
            return NULL;
    }
    l.max_bytes = PyLong_AsUnsignedLongLong(args[7]);
    const unsigned long max_runs = PyLong_AsUnsignedLong(args[8]);
    const unsigned long status = PyLong_AsUnsignedLong(args[9]);
    if (PyErr_Occurred())
        return NULL;
    if (fd < 0 || max_runs > MAX_NATIVE_RUNS || status > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "serve(): bad fd, max_runs (at most 1024) or status");
        return NULL;
    }
    l.max_runs = (uint32_t)max_runs;
    l.not_exist_status = (uint32_t)status;
    struct request *rq = PyMem_RawMalloc(sizeof *rq);
    if (rq == NULL)
        return PyErr_NoMemory();
    enum outcome o;
    Py_BEGIN_ALLOW_THREADS
    do {
        rq->why = NULL;
        rq->error = 0;
        o = serve_one(self, fd, &l, rq);
    } while (o == SERVED);
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    switch (o) {
    case PEER_GONE:
        result = Py_NewRef(Py_None);
        break;
    case HAND_BACK:
        result = PyBytes_FromStringAndSize((const char *)rq->frame, (Py_ssize_t)rq->frame_bytes);
        break;
    case FAULTED:
        result = PyLong_FromLongLong(rq->faulted_cache);
        break;
    case TIMED_OUT:
        PyErr_SetString(PyExc_TimeoutError, rq->why);
        break;
    case ABORTED:
        PyErr_SetString(PyExc_ConnectionAbortedError, rq->why);
        break;
    case BROKEN:
        PyErr_SetString(PyExc_ConnectionError, rq->why);
        break;
    case OS_ERROR:
    case SERVED:
        errno = rq->error;
        PyErr_SetFromErrno(PyExc_OSError);
        break;
    }
    PyMem_RawFree(rq);
    return result;
}

PyDoc_STRVAR(put_doc,
"put(cache_id, tensor_nbytes, addresses, /) -> None\n--\n\n"
"Lets serve() answer reads of cache `cache_id`: one tensor of tensor_nbytes bytes at each address of `addresses`\n"
"(a contiguous uint64 buffer). The caller keeps that memory mapped until drop(cache_id) returns. A cache already\n"
"in the table is left as it is.");

static PyObject *table_put(ReadTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "put() takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    const long long cache_id = PyLong_AsLongLong(args[0]);
    const unsigned long long nbytes = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[2], &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (view.len % 8 != 0 || view.len == 0 || view.len / 8 > UINT32_MAX) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "put(): addresses must be a non-empty uint64 buffer");
        return NULL;
    }
    struct region *r = PyMem_RawCalloc(1, sizeof *r);
    uint64_t *addresses = PyMem_RawMalloc((size_t)view.len);
    if (r == NULL || addresses == NULL) {
        PyMem_RawFree(r);
        PyMem_RawFree(addresses);
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    memcpy(addresses, view.buf, (size_t)view.len);
    r->cache_id = cache_id;
    r->num_tensors = (uint32_t)(view.len / 8);
    r->tensor_nbytes = nbytes;
    r->addresses = addresses;
    PyBuffer_Release(&view);
    int kept = 0, grown = 1;
    pthread_mutex_lock(&self->lock);
    for (Py_ssize_t i = 0; i < self->count; i++)
        kept |= self->regions[i]->cache_id == cache_id;
    if (!kept && self->count == self->capacity) {
        const Py_ssize_t capacity = self->capacity ? 2 * self->capacity : 16;
        struct region **more = PyMem_RawRealloc(self->regions, (size_t)capacity * sizeof *more);
        if (more != NULL) {
            self->regions = more;
            self->capacity = capacity;
        } else {
            grown = 0;
        }
    }
    if (!kept && grown)
        self->regions[self->count++] = r;
    pthread_mutex_unlock(&self->lock);
    if (kept || !grown) {
        PyMem_RawFree(addresses);
        PyMem_RawFree(r);
        if (!grown)
            return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(drop_doc,
"drop(cache_id, /) -> bool\n--\n\n"
"Takes cache `cache_id` out of the table and waits (the GIL released) until no read sends from it any more; those\n"
"under way end as soon as their peer stops taking bytes. False when the table did not hold it.");

static PyObject *table_drop(ReadTable *self, PyObject *arg) {
    const long long cache_id = PyLong_AsLongLong(arg);
    if (cache_id == -1 && PyErr_Occurred())
        return NULL;
    struct region *found = NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    for (Py_ssize_t i = 0; i < self->count; i++) {
        if (self->regions[i]->cache_id == cache_id) {
            found = self->regions[i];
            self->regions[i] = self->regions[--self->count];
            break;
        }
    }
    if (found != NULL) {
        found->dropped = 1;
        while (found->users > 0)
            pthread_cond_wait(&self->released, &self->lock);
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (found == NULL)
        Py_RETURN_FALSE;
    PyMem_RawFree(found->addresses);
    PyMem_RawFree(found);
    Py_RETURN_TRUE;
}

static PyObject *table_len(ReadTable *self, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&self->lock);
    const Py_ssize_t n = self->count;
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromSsize_t(n);
}

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "ReadTable() takes no arguments");
        return NULL;
    }
    ReadTable *self = (ReadTable *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->released, NULL);
    return (PyObject *)self;
}

static void table_dealloc(ReadTable *self) {
    /* No serve() runs: each holds a reference to the table. */
    for (Py_ssize_t i = 0; i < self->count; i++) {
        PyMem_RawFree(self->regions[i]->addresses);
        PyMem_RawFree(self->regions[i]);
    }
    PyMem_RawFree(self->regions);
    pthread_mutex_destroy(&self->lock);
    pthread_cond_destroy(&self->released);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef table_methods[] = {
    {"serve", (PyCFunction)(void (*)(void))table_serve, METH_FASTCALL, serve_doc},
    {"put", (PyCFunction)(void (*)(void))table_put, METH_FASTCALL, put_doc},
    {"drop", (PyCFunction)table_drop, METH_O, drop_doc},
    {"size", (PyCFunction)table_len, METH_NOARGS, "size() -> int\n--\n\nCaches in the table."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReadTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbrokerd._tcpread.ReadTable",
    .tp_basicsize = sizeof(ReadTable),
    .tp_dealloc = (destructor)table_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The caches whose reads serve() answers without Python (see the module's doc).",
    .tp_methods = table_methods,
    .tp_new = table_new,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvbrokerd._tcpread",
    "The tcp data port's READs served without Python: see ReadTable.serve().", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tcpread(void) {
    if (PyType_Ready(&ReadTableType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "ReadTable", (PyObject *)&ReadTableType) < 0 ||
        PyModule_AddIntConstant(module, "MAX_RUNS", MAX_NATIVE_RUNS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
