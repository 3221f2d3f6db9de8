/* kvbrokerd._safecopy: memmove between mappings that may lose pages under the copy, as an exception instead of a
 * signal that kills the process.
 *
 * A model server can truncate a segment it registered while the daemon copies from or into it. A plain memmove that
 * touches a page past the new end gets SIGBUS (SIGSEGV for a page no longer mapped at all) and the daemon dies.
 * Here each copy runs with a per-thread guard set; a process-wide SIGBUS/SIGSEGV handler jumps back into the copy
 * only when the signal was raised by the kernel for an address inside the guarded copy's own source or destination
 * on that same thread. Every other fault goes to whichever handler was installed before this module was imported
 * (faulthandler's, or the default action), so a real crash still crashes, with its traceback.
 *
 * Bounded on purpose: one copy function (many runs with the GIL released once) and its strided form (a run
 * repeated at a fixed step, as a block-size remap's plan keeps it), no dependencies, the GIL
 * released for the copy only. See
 * tests/unit/test_safecopy.py and docs/benchmarks-history.md ("which native helper, and why").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

/* A run advances in steps of this many bytes so that a fault can say how much of it surely landed; large enough
 * that glibc's memmove keeps its full speed within a step. */
#define STEP ((size_t)1 << 20)

struct guard {
    sigjmp_buf env;
    uintptr_t src_lo, src_hi, dst_lo, dst_hi; /* page-rounded: a fault address may be reported page-aligned */
    volatile uintptr_t fault_address;
    volatile int fault_signal;
};

/* Initial-exec TLS: reading it in a signal handler never allocates (a dlopen'ed module's lazily allocated TLS
 * could call malloc there). If the static TLS surplus is exhausted the import fails and kvbrokerd falls back to the
 * kernel copy. */
static __thread struct guard *volatile current_guard __attribute__((tls_model("initial-exec")));

static struct sigaction previous_bus, previous_segv;
static int handler_installed; /* once per process: a second install would take itself for the previous handler */
static PyObject *FaultError;
static uintptr_t page_size;

static int in_range(uintptr_t address, uintptr_t lo, uintptr_t hi) { return address >= lo && address < hi; }

static void pass_on(int sig, siginfo_t *info, void *context) {
    struct sigaction *previous = sig == SIGBUS ? &previous_bus : &previous_segv;
    if (previous->sa_flags & SA_SIGINFO) {
        previous->sa_sigaction(sig, info, context);
        return;
    }
    if (previous->sa_handler != SIG_DFL && previous->sa_handler != SIG_IGN) {
        previous->sa_handler(sig);
        return;
    }
    /* The disposition that was there before us takes over for good: a fault re-executes its instruction and gets
     * it (the kernel forces the default action on an ignored fault), a sent signal is sent again. */
    sigaction(sig, previous, NULL);
    if (info->si_code <= 0)
        raise(sig);
}

static void on_fault(int sig, siginfo_t *info, void *context) {
    struct guard *guard = current_guard;
    /* si_code > 0: raised by the kernel for a memory access, not sent by kill() or raise(). */
    if (guard != NULL && info->si_code > 0) {
        uintptr_t address = (uintptr_t)info->si_addr;
        if (in_range(address, guard->src_lo, guard->src_hi) || in_range(address, guard->dst_lo, guard->dst_hi)) {
            guard->fault_address = address;
            guard->fault_signal = sig;
            current_guard = NULL;
            siglongjmp(guard->env, 1);
        }
    }
    pass_on(sig, info, context);
}

static int install_handler(void) {
    if (handler_installed)
        return 0;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fault;
    /* SA_ONSTACK: a thread with an alternate stack (faulthandler gives the main thread one) handles even a stack
     * overflow before passing it on. No SA_NODEFER: the copy unblocks the one signal it caught. */
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, NULL, &previous_bus) != 0 || sigaction(SIGSEGV, NULL, &previous_segv) != 0)
        return -1;
    if (sigaction(SIGBUS, &action, NULL) != 0)
        return -1;
    if (sigaction(SIGSEGV, &action, NULL) != 0) {
        sigaction(SIGBUS, &previous_bus, NULL);
        return -1;
    }
    handler_installed = 1;
    return 0;
}

static uintptr_t page_down(uintptr_t a, uintptr_t page) { return a & ~(page - 1); }
static uintptr_t page_up(uintptr_t a, uintptr_t page) {
    return a > UINTPTR_MAX - (page - 1) ? UINTPTR_MAX : page_down(a + page - 1, page);
}

/* Raises FaultError for run `run` of a copy (and, when `repeat` >= 0, its repetition `repeat`). */
static PyObject *raise_fault(const struct guard *guard, size_t copied, size_t n, Py_ssize_t run,
                             Py_ssize_t repeat) {
    int source = in_range(guard->fault_address, guard->src_lo, guard->src_hi);
    PyObject *error = PyObject_CallFunction(
        FaultError, "s", source ? "the source's memory vanished under the copy"
                                : "the destination's memory vanished under the copy");
    if (error == NULL)
        return NULL;
    PyObject *side = PyUnicode_FromString(source ? "source" : "destination");
    PyObject *done = PyLong_FromSize_t(copied);
    PyObject *total = PyLong_FromSize_t(n);
    PyObject *address = PyLong_FromUnsignedLongLong(guard->fault_address);
    PyObject *sig = PyLong_FromLong(guard->fault_signal);
    PyObject *at = PyLong_FromSsize_t(run);
    PyObject *rep = repeat >= 0 ? PyLong_FromSsize_t(repeat) : Py_NewRef(Py_None);
    if (side && done && total && address && sig && at && rep && PyObject_SetAttrString(error, "side", side) == 0 &&
        PyObject_SetAttrString(error, "copied", done) == 0 && PyObject_SetAttrString(error, "size", total) == 0 &&
        PyObject_SetAttrString(error, "address", address) == 0 && PyObject_SetAttrString(error, "signal", sig) == 0 &&
        PyObject_SetAttrString(error, "run", at) == 0 &&
        (repeat < 0 || PyObject_SetAttrString(error, "repeat", rep) == 0))
        PyErr_SetObject(FaultError, error);
    Py_XDECREF(at);
    Py_XDECREF(rep);
    Py_XDECREF(side);
    Py_XDECREF(done);
    Py_XDECREF(total);
    Py_XDECREF(address);
    Py_XDECREF(sig);
    Py_DECREF(error);
    return NULL;
}

/* One run of copy_runs() under the guard, in steps of STEP; returns 0, or 1 after a fault (guard says where, *copied
 * how many leading bytes of the run surely landed). */
static int guarded_run(struct guard *guard, uintptr_t dst, uintptr_t src, size_t n, volatile size_t *copied) {
    const uintptr_t page = page_size;
    guard->src_lo = page_down(src, page);
    guard->src_hi = page_up(src + n, page);
    guard->dst_lo = page_down(dst, page);
    guard->dst_hi = page_up(dst + n, page);
    *copied = 0;
    if (sigsetjmp(guard->env, 0) == 0) {
        current_guard = guard;
        atomic_signal_fence(memory_order_seq_cst);
        while (*copied < n) {
            const size_t done = *copied, step = n - done < STEP ? n - done : STEP;
            memmove((void *)(dst + done), (const void *)(src + done), step);
            /* The step's bytes are written before it counts as copied. */
            atomic_signal_fence(memory_order_seq_cst);
            *copied = done + step;
        }
        current_guard = NULL;
        return 0;
    }
    /* Back from the handler by siglongjmp: the kernel blocked the caught signal on entry and nothing restored the
     * mask. It was unblocked before (a blocked fault kills outright), so unblocking it restores the mask. */
    sigset_t caught;
    sigemptyset(&caught);
    sigaddset(&caught, guard->fault_signal);
    pthread_sigmask(SIG_UNBLOCK, &caught, NULL);
    return 1;
}

static int u64_buffer(PyObject *arg, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(arg, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL || (strcmp(view->format, "Q") != 0 &&
                                                        strcmp(view->format, "L") != 0 &&
                                                        strcmp(view->format, "<Q") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous buffer of uint64", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_runs_doc,
"copy_runs(dst, src, n, /) -> None\n--\n\n"
"memmove(dst[i], src[i], n[i]) between raw addresses for every i, in order, with the GIL released once for all of\n"
"them; dst, src and n are equally long contiguous uint64 buffers (numpy arrays). Runs must not overlap each other\n"
"or themselves; a run with a null address or past the end of the address space is refused (ValueError) before any\n"
"byte moves. A page of either side that vanishes under the copy (SIGBUS, or SIGSEGV for an unmapped one) raises\n"
"FaultError instead of killing the process: its `run` is the index of the run that faulted (every run before it\n"
"landed), `side` says which side lost the page, `copied` how many leading bytes of that run surely landed. The\n"
"caller keeps every range mapped.");

static PyObject *safecopy_copy_runs(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "copy_runs() takes 3 arguments (dst, src, n), got %zd", nargs);
        return NULL;
    }
    Py_buffer dv, sv, nv;
    if (u64_buffer(args[0], &dv, "dst") < 0)
        return NULL;
    if (u64_buffer(args[1], &sv, "src") < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    if (u64_buffer(args[2], &nv, "n") < 0) {
        PyBuffer_Release(&dv);
        PyBuffer_Release(&sv);
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t count = nv.len / 8;
    const uint64_t *dst = dv.buf, *src = sv.buf, *len = nv.buf;
    if (dv.len != nv.len || sv.len != nv.len) {
        PyErr_SetString(PyExc_ValueError, "copy_runs(): dst, src and n differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        const uint64_t d = dst[i], s = src[i], l = len[i];
        if (l == 0)
            continue;
        /* l first: the other bounds then hold where an address is narrower than uint64 too. */
        if (d == 0 || s == 0 || l > UINTPTR_MAX || d > UINTPTR_MAX - l || s > UINTPTR_MAX - l ||
            (d < s + l && s < d + l)) {
            PyErr_Format(PyExc_ValueError, "copy_runs(): run %zd has a null address, overlaps itself or passes the "
                         "end of the address space", i);
            goto done;
        }
    }
    struct guard guard;
    guard.fault_address = 0;
    guard.fault_signal = 0;
    volatile size_t copied = 0;
    Py_ssize_t faulted_at = -1;
    PyThreadState *const released = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < count; i++) {
        if (len[i] != 0 && guarded_run(&guard, (uintptr_t)dst[i], (uintptr_t)src[i], (size_t)len[i], &copied)) {
            faulted_at = i;
            break;
        }
    }
    PyEval_RestoreThread(released);
    if (faulted_at >= 0) {
        raise_fault(&guard, copied, (size_t)len[faulted_at], faulted_at, -1);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dv);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&nv);
    return result;
}

/* One entry of copy_strided() under the guard: `times` repetitions of n bytes, repetition k from src + k * src_step
 * to dst + k * dst_step. One sigsetjmp for all of them, the guard spanning the entry's bounding ranges; returns 0, or
 * 1 after a fault (*repeat says which repetition, *copied how many of its leading bytes surely landed). */
#if defined(__SSE2__)
#include <emmintrin.h>
/* Streaming (non-temporal) stores for short repetitions of a large copy: a 64-byte store through the cache first
 * reads the line it overwrites (twice the memory traffic), which glibc's memmove avoids for large copies by
 * streaming; without this, 64-byte repetitions copied at ~0.6x the speed of the same bytes in large runs (with it,
 * at about the speed of large runs; docs/benchmarks-history.md, "strided plans"). Only for whole, aligned cache
 * lines (a partial line streams far slower than it caches): repetitions of up to 256 bytes, with gaps between them or
 * back to back (a 64 -> 32 remap's destination), and entries done once (a remap's V rows, 8 KiB each), which memmove
 * writes through the cache below its own streaming size. Since the plan copies in source order, streaming the back to
 * back rows and the entries done once measured faster too (in-process, one thread, 32 MiB: 64 -> 32 6.3-6.7 ms
 * against 4.5-5.0, 32 -> 64 5.2-5.7 against 4.9-5.0, 8 large runs by copy_runs 4.7-5.1; docs/benchmarks-history.md,
 * 2026-12-06 (4)). */
#define HAVE_STREAMING 1
static void stream_repeats(uintptr_t dst, uintptr_t src, size_t n, size_t times, size_t dst_step, size_t src_step,
                           volatile size_t *repeat) {
    for (size_t k = 0; k < times; k++) {
        char *d = (char *)(dst + k * dst_step);
        const char *s = (const char *)(src + k * src_step);
        for (size_t at = 0; at < n; at += 16)
            _mm_stream_si128((__m128i *)(d + at), _mm_loadu_si128((const __m128i *)(s + at)));
        atomic_signal_fence(memory_order_seq_cst);
        *repeat = k + 1;
    }
    _mm_sfence(); /* the streamed bytes are visible before the call returns */
}
#else
#define HAVE_STREAMING 0
#endif

/* Short repetitions of a constant size: the compiler inlines the copy (a memmove call per 64-byte repetition cost
 * about twice the bytes' own time). A repetition never overlaps itself (checked), so memcpy is exact. */
#define SHORT_REPEATS(size)                                                                                         \
    case size:                                                                                                      \
        for (size_t k = 0; k < times; k++) {                                                                        \
            memcpy((void *)(dst + k * dst_step), (const void *)(src + k * src_step), size);                         \
            atomic_signal_fence(memory_order_seq_cst);                                                              \
            *repeat = k + 1;                                                                                        \
        }                                                                                                           \
        return;

/* The repetitions of one strided entry (inside guarded_strided's guard); its own function so that no register
 * variable of the caller is live across sigsetjmp. `stream`: the whole call is large (see stream_repeats). */
static __attribute__((noinline)) void strided_copy(uintptr_t dst, uintptr_t src, size_t n, size_t times,
                                                   size_t dst_step, size_t src_step, int stream,
                                                   volatile size_t *repeat, volatile size_t *copied) {
#if HAVE_STREAMING
    if (stream && n % 64 == 0 && (dst & 63) == 0 && ((n <= 256 && (dst_step & 63) == 0) || times == 1)) {
        stream_repeats(dst, src, n, times, dst_step, src_step, repeat);
        return;
    }
#else
    (void)stream;
#endif
    switch (n) {
        SHORT_REPEATS(16)
        SHORT_REPEATS(32)
        SHORT_REPEATS(64)
        SHORT_REPEATS(128)
        SHORT_REPEATS(256)
    default:
        break;
    }
    for (size_t k = 0; k < times; k++) {
        const uintptr_t d = dst + k * dst_step, s = src + k * src_step;
        while (*copied < n) {
            const size_t done = *copied, step = n - done < STEP ? n - done : STEP;
            memmove((void *)(d + done), (const void *)(s + done), step);
            /* The step's bytes are written before it counts as copied. */
            atomic_signal_fence(memory_order_seq_cst);
            *copied = done + step;
        }
        *copied = 0;
        *repeat = k + 1;
        atomic_signal_fence(memory_order_seq_cst);
    }
}

/* Calls whose bytes reach this stream their short repetitions (about where glibc's memmove starts streaming). */
#define STREAM_MIN_BYTES ((uint64_t)4 << 20)

struct strided_entry {
    uintptr_t dst, src;
    size_t n, times, dst_step, src_step;
    int stream;
};

/* One entry of copy_strided() under the guard: `times` repetitions of n bytes, repetition k from src + k * src_step
 * to dst + k * dst_step. One sigsetjmp for all of them, the guard spanning the entry's bounding ranges; returns 0, or
 * 1 after a fault (*repeat says which repetition, *copied how many of its leading bytes surely landed). */
static int guarded_strided(struct guard *guard, const struct strided_entry *e, volatile size_t *repeat,
                           volatile size_t *copied) {
    const uintptr_t page = page_size;
    guard->src_lo = page_down(e->src, page);
    guard->src_hi = page_up(e->src + (e->times - 1) * e->src_step + e->n, page);
    guard->dst_lo = page_down(e->dst, page);
    guard->dst_hi = page_up(e->dst + (e->times - 1) * e->dst_step + e->n, page);
    *repeat = 0;
    *copied = 0;
    if (sigsetjmp(guard->env, 0) == 0) {
        current_guard = guard;
        atomic_signal_fence(memory_order_seq_cst);
        strided_copy(e->dst, e->src, e->n, e->times, e->dst_step, e->src_step, e->stream, repeat, copied);
        current_guard = NULL;
        return 0;
    }
#if HAVE_STREAMING
    _mm_sfence(); /* what was streamed before the fault is visible before the caller hears of it */
#endif
    sigset_t caught; /* as in guarded_run */
    sigemptyset(&caught);
    sigaddset(&caught, guard->fault_signal);
    pthread_sigmask(SIG_UNBLOCK, &caught, NULL);
    return 1;
}

/* Whether entry (d, s, n, times, steps) is refused: a null address, an end past the address space, or a repetition
 * whose source and destination overlap. Overflow-safe: each product is checked before it is formed. */
static int bad_strided(uint64_t d, uint64_t s, uint64_t n, uint64_t times, uint64_t ds, uint64_t ss) {
    if (d == 0 || s == 0 || n > UINTPTR_MAX)
        return 1;
    const uint64_t reps = times - 1;
    if (reps && (ds > (UINTPTR_MAX - n) / reps || ss > (UINTPTR_MAX - n) / reps))
        return 1;
    const uint64_t d_span = reps * ds + n, s_span = reps * ss + n;
    if (d > UINTPTR_MAX - d_span || s > UINTPTR_MAX - s_span)
        return 1;
    if (!(d < s + s_span && s < d + d_span))
        return 0; /* bounding ranges apart: no repetition overlaps itself */
    for (uint64_t k = 0; k < times; k++) {
        const uint64_t dk = d + k * ds, sk = s + k * ss;
        if (dk < sk + n && sk < dk + n)
            return 1;
    }
    return 0;
}

PyDoc_STRVAR(copy_strided_doc,
"copy_strided(dst, src, n, count, dst_step, src_step, /) -> None\n--\n\n"
"copy_runs() of strided entries: entry i copies n[i] bytes count[i] times, repetition k from src[i] + k *\n"
"src_step[i] to dst[i] + k * dst_step[i], entry after entry, with the GIL released once for all of them; six\n"
"equally long contiguous uint64 buffers. Refused (ValueError) before any byte moves: a null address, an entry past\n"
"the end of the address space, a repetition that overlaps itself. A vanished page raises FaultError as copy_runs()\n"
"does: `run` is the entry, `repeat` the repetition that faulted (every one before it landed), `copied` how many\n"
"leading bytes of that repetition surely landed.");

static PyObject *safecopy_copy_strided(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    static const char *const names[6] = {"dst", "src", "n", "count", "dst_step", "src_step"};
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "copy_strided() takes 6 arguments (dst, src, n, count, dst_step, src_step), "
                     "got %zd", nargs);
        return NULL;
    }
    Py_buffer views[6];
    int held = 0;
    PyObject *result = NULL;
    for (; held < 6; held++)
        if (u64_buffer(args[held], &views[held], names[held]) < 0)
            goto done;
    const Py_ssize_t count = views[2].len / 8;
    for (int i = 0; i < 6; i++) {
        if (views[i].len != views[2].len) {
            PyErr_SetString(PyExc_ValueError, "copy_strided(): the six buffers differ in length");
            goto done;
        }
    }
    const uint64_t *dst = views[0].buf, *src = views[1].buf, *len = views[2].buf, *times = views[3].buf,
                   *dstep = views[4].buf, *sstep = views[5].buf;
    uint64_t total = 0; /* saturating: only compared with STREAM_MIN_BYTES */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (len[i] == 0 || times[i] == 0)
            continue;
        if (total < STREAM_MIN_BYTES)
            total += times[i] > STREAM_MIN_BYTES / len[i] ? STREAM_MIN_BYTES : times[i] * len[i];
        if (bad_strided(dst[i], src[i], len[i], times[i], dstep[i], sstep[i])) {
            PyErr_Format(PyExc_ValueError, "copy_strided(): entry %zd has a null address, overlaps itself or passes "
                         "the end of the address space", i);
            goto done;
        }
    }
    struct guard guard;
    guard.fault_address = 0;
    guard.fault_signal = 0;
    volatile size_t repeat = 0, copied = 0;
    Py_ssize_t faulted_at = -1;
    PyThreadState *const released = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < count; i++) {
        const struct strided_entry entry = {(uintptr_t)dst[i], (uintptr_t)src[i], (size_t)len[i], (size_t)times[i],
                                            (size_t)dstep[i], (size_t)sstep[i], total >= STREAM_MIN_BYTES};
        if (entry.n != 0 && entry.times != 0 && guarded_strided(&guard, &entry, &repeat, &copied)) {
            faulted_at = i;
            break;
        }
    }
    PyEval_RestoreThread(released);
    if (faulted_at >= 0) {
        raise_fault(&guard, copied, (size_t)len[faulted_at], faulted_at, (Py_ssize_t)repeat);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    return result;
}

PyDoc_STRVAR(handler_in_place_doc,
"handler_in_place()\n--\n\n"
"True while this module's fault handler is the one installed for SIGBUS and SIGSEGV. If something installed its\n"
"own afterwards (faulthandler.enable() after import), a fault in a copy reaches that one first.");

static PyObject *safecopy_handler_in_place(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    struct sigaction bus, segv;
    if (sigaction(SIGBUS, NULL, &bus) != 0 || sigaction(SIGSEGV, NULL, &segv) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong((bus.sa_flags & SA_SIGINFO) && bus.sa_sigaction == on_fault &&
                           (segv.sa_flags & SA_SIGINFO) && segv.sa_sigaction == on_fault);
}

static PyMethodDef methods[] = {
    {"copy_runs", (PyCFunction)(void (*)(void))safecopy_copy_runs, METH_FASTCALL, copy_runs_doc},
    {"copy_strided", (PyCFunction)(void (*)(void))safecopy_copy_strided, METH_FASTCALL, copy_strided_doc},
    {"handler_in_place", safecopy_handler_in_place, METH_NOARGS, handler_in_place_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvbrokerd._safecopy",
    "memmove that turns a vanished page into FaultError instead of SIGBUS (see copy_runs()).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__safecopy(void) {
    page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    FaultError = PyErr_NewExceptionWithDoc(
        "kvbrokerd._safecopy.FaultError",
        "A page under a copy vanished. Attributes: side ('source' or 'destination'), copied (leading bytes that "
        "surely landed), size, address (of the fault), signal (SIGBUS or SIGSEGV), run (of copy_runs(): which one; "
        "of copy_strided(): which entry), repeat (of copy_strided(): which repetition of the entry).",
        NULL, NULL);
    if (FaultError == NULL || PyModule_AddObjectRef(module, "FaultError", FaultError) < 0 ||
        PyModule_AddIntConstant(module, "STEP", (long)STEP) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    if (install_handler() != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
