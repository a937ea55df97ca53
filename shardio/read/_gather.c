/* shardio.read._gather: copy a batch's slices of shards into one buffer in one native call, with the GIL
 * released: from memory maps (gather_into) or with pread from the files (read_into); and ask the kernel to
 * read ahead the slices of a batch still to come (will_need).
 *
 * Why: with the default shuffle (blocks of 1) a batch of 256 is 256 slices of 256 different places in the
 * shards. torch.cat over 256 tensors spread the copy over torch's OpenMP threads, which on a machine whose
 * cores are busy (the training loop's own copy, the step) wait for each other: 0.18 of np.copyto against
 * 0.96 sequential (bench.reader). Here the slices' bytes are split evenly over a few plain threads of a
 * pool (the caller says how many; one copies with streaming stores, see copy_streaming); nothing spins,
 * and the training loop's thread runs meanwhile. Which of maps and pread, and why: shardio/read/gather.py.
 *
 * Optional, like the other extensions (setup.py): without it shardio.read.gather copies with numpy, the
 * same bytes in the same places.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(SHARDIO_NO_STREAM)
#include <emmintrin.h>
#define HAVE_STREAM 1
#endif

/* Threads never get less than this much to copy: waking one costs a few microseconds, 4 MB ~0.2-0.5 ms. */
#define MIN_BYTES_PER_THREAD (4 << 20)
/* Batches from this size on, copied on one thread, are written with streaming stores (copy_streaming);
 * smaller ones stay in the cache for whoever reads them next (a 64x64 batch of 256 is 3 MB). */
#define STREAM_MIN_BYTES (8 << 20)
#define MAX_THREADS 64

/* The copy threads: a small pool of plain pthreads started on first use and kept, rather than started for
 * each batch (up to 7 a batch at the default of 8 threads). One job at a time (a second caller waits its
 * turn, its GIL released); the calling thread takes shares too, and any share no thread took. A job can also
 * be started and waited for later (gather_start: the pool copies while the caller builds the rest of the
 * batch), so the turn is a flag any thread may give back, not a mutex its locker must unlock. A forked child
 * (a DataLoader worker) has none of the parent's threads: pthread_atfork empties the pool there, and the
 * child starts its own on its first batch. */
typedef void (*share_fn)(void *job, int share, int shares);

static struct {
    pthread_mutex_t lock;      /* the fields below */
    pthread_cond_t start;      /* a new job (generation moved on) */
    pthread_cond_t finished;   /* remaining reached 0 */
    pthread_cond_t idle;       /* busy went back to 0 */
    int busy;                  /* a job was submitted and not yet waited for */
    int started;               /* that job was started (gather_start), to be waited for by `owner` */
    pthread_t owner;
    int size;                  /* worker threads started */
    unsigned long generation;
    share_fn fn;
    void *job;
    int shares, next_share, remaining;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .start = PTHREAD_COND_INITIALIZER,
          .finished = PTHREAD_COND_INITIALIZER, .idle = PTHREAD_COND_INITIALIZER};

/* Takes and runs shares of the current job until none is left; called with pool.lock held, returns with it. */
static void take_shares(void) {
    while (pool.next_share < pool.shares) {
        int share = pool.next_share++;
        share_fn fn = pool.fn;
        void *job = pool.job;
        int shares = pool.shares;
        pthread_mutex_unlock(&pool.lock);
        fn(job, share, shares);
        pthread_mutex_lock(&pool.lock);
        if (--pool.remaining == 0) pthread_cond_signal(&pool.finished);
    }
}

/* arg: the generation before the job it was started for, so that it joins that job. */
static void *pool_worker(void *arg) {
    unsigned long seen = (unsigned long)(uintptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.start, &pool.lock);
        seen = pool.generation;
        take_shares();
    }
    return NULL;
}

static void pool_after_fork(void) {
    /* The child has only the forking thread: no workers, and the locks as nobody holds them. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
    pool.lock = fresh;
    pool.start = cond;
    pool.finished = cond;
    pool.idle = cond;
    pool.busy = pool.started = 0;
    pool.size = 0;
    pool.shares = pool.next_share = pool.remaining = 0;
}

/* Hands fn(job, s, shares) for s in 0..shares-1 to the pool once the job before is waited for, with at
 * least `workers` threads started to take them, and returns 0; pool_wait ends it. -1 (nothing submitted)
 * where the job before is one this thread started and has not waited for: waiting would never end.
 * `started`: a job the caller waits for later (gather_start). Without the GIL. */
static int pool_submit(share_fn fn, void *job, int shares, int workers, int started) {
    pthread_mutex_lock(&pool.lock);
    if (pool.busy && pool.started && pthread_equal(pool.owner, pthread_self())) {
        pthread_mutex_unlock(&pool.lock);
        return -1;
    }
    while (pool.busy) pthread_cond_wait(&pool.idle, &pool.lock);
    pool.busy = 1;
    pool.started = started;
    pool.owner = pthread_self();
    while (pool.size < workers && pool.size < MAX_THREADS) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&id, &attr, pool_worker, (void *)(uintptr_t)pool.generation);
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer threads: the caller takes the shares left */
        pool.size++;
    }
    pool.fn = fn, pool.job = job, pool.shares = shares, pool.next_share = 0, pool.remaining = shares;
    pool.generation++;
    pthread_cond_broadcast(&pool.start);
    pthread_mutex_unlock(&pool.lock);
    return 0;
}

/* Takes the submitted job's shares no thread took yet, waits until all are done and gives the turn back
 * (any thread may call it). Without the GIL. */
static void pool_wait(void) {
    pthread_mutex_lock(&pool.lock);
    take_shares();
    while (pool.remaining > 0) pthread_cond_wait(&pool.finished, &pool.lock);
    pool.shares = 0;
    pool.busy = pool.started = 0;
    pthread_cond_signal(&pool.idle);
    pthread_mutex_unlock(&pool.lock);
}

/* fn(job, s, shares) for s in 0..shares-1 on up to `shares` threads (the caller's included), returning 0 when
 * all are done; -1 (nothing done) where this thread started a job it has not waited for. Without the GIL. */
static int run_shares(share_fn fn, void *job, int shares) {
    if (shares <= 1) {
        fn(job, 0, 1);
        return 0;
    }
    if (pool_submit(fn, job, shares, shares - 1, 0) != 0) return -1;
    pool_wait();
    return 0;
}

static PyObject *not_waited(void) {
    PyErr_SetString(PyExc_RuntimeError, "a copy this thread started (gather_start) was not waited for before the "
                                        "next one");
    return NULL;
}

/* The threads a job of `total` bytes is split over: at most `threads`, MIN_BYTES_PER_THREAD each. */
static int shares_for(Py_ssize_t total, int threads) {
    Py_ssize_t wanted = total / MIN_BYTES_PER_THREAD;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (wanted < threads) threads = wanted < 1 ? 1 : (int)wanted;
    return threads;
}

/* A batch: its pieces in order, where each starts in out (offsets[count] is the total), and where each is read
 * from: a buffer (a slice of a memory map: gather_into) or a file at an offset (read_into). */
typedef struct {
    Py_ssize_t *offsets;
    Py_ssize_t count;
    char *out;
    Py_buffer *views;       /* gather_into */
    const int64_t *files;   /* read_into: (fd, offset, nbytes) per piece */
    int stream;             /* gather_into: streaming stores (a batch larger than the cache) */
    Py_ssize_t failed;      /* read_into: the first piece that failed (-1: none) */
    int failed_errno;       /* its errno; 0: the file ended before the piece did */
} gather_job;

/* memcpy whose stores bypass the cache (x86-64: SSE2 streaming stores): a batch of 256x256 images (50 MB)
 * is larger than the last-level cache, so a plain store first reads the destination line it overwrites;
 * streaming stores spare that read, a third of the copy's memory traffic. glibc does this itself only for
 * copies larger than about the cache (a whole batch's np.copyto), not per 196 KB slice.
 * Used when the batch is copied on one thread (the caller gives one where cores are few): there one core
 * fills the memory bus (the 2-core dev VM: np.copyto 21 GB/s on one core, 23 on two), and the shuffled
 * read with the training loop's copy beside it went from 0.44-0.47 to 0.49-0.58 of np.copyto. On a
 * 16-core GPU host a core copies at ~9 GB/s of a far wider bus, and with 8 threads plain stores were the
 * faster (pinned batches, 27.5 against 23.7 GB/s shuffled, 36.4 against 32.2 sequential). */
static void copy_streaming(char *dst, const char *src, size_t n) {
#ifdef HAVE_STREAM
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (n < 4096 || head > n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++, dst += 64, src += 64) {
#ifdef PREFETCH_AHEAD
        _mm_prefetch(src + PREFETCH_AHEAD, _MM_HINT_T0);
#endif
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n % 64);
#else
    memcpy(dst, src, n);
#endif
}

/* Share `share` of `shares` of out's bytes: [begin, end), and the first piece ending after begin. */
static Py_ssize_t share_bounds(const gather_job *job, int share, int shares, Py_ssize_t *begin, Py_ssize_t *end) {
    Py_ssize_t total = job->offsets[job->count];
    *begin = total / shares * share;
    *end = share == shares - 1 ? total : total / shares * (share + 1);
    Py_ssize_t low = 0, high = job->count - 1; /* binary search: pieces are in order */
    while (low < high) {
        Py_ssize_t mid = low + (high - low) / 2;
        if (job->offsets[mid + 1] <= *begin) low = mid + 1;
        else high = mid;
    }
    return low;
}

/* gather_into's share: out[begin:end) copied from the slices that hold those bytes. */
static void copy_share(void *arg, int share, int shares) {
    gather_job *job = (gather_job *)arg;
    Py_ssize_t begin, end;
    Py_ssize_t first = share_bounds(job, share, shares, &begin, &end);
    if (begin >= end) return;
    for (Py_ssize_t i = first; i < job->count && job->offsets[i] < end; i++) {
        Py_ssize_t from = job->offsets[i] > begin ? job->offsets[i] : begin;
        Py_ssize_t to = job->offsets[i + 1] < end ? job->offsets[i + 1] : end;
        if (to <= from) continue;
        const char *src = (const char *)job->views[i].buf + (from - job->offsets[i]);
        if (job->stream) copy_streaming(job->out + from, src, (size_t)(to - from));
        else memcpy(job->out + from, src, (size_t)(to - from));
    }
#ifdef HAVE_STREAM
    if (job->stream) _mm_sfence(); /* streaming stores are weakly ordered: visible before the batch is read */
#endif
}

/* read_into's share: out[begin:end) read from the files with pread, straight into out. */
static void read_share(void *arg, int share, int shares) {
    gather_job *job = (gather_job *)arg;
    Py_ssize_t begin, end;
    Py_ssize_t first = share_bounds(job, share, shares, &begin, &end);
    for (Py_ssize_t i = first; begin < end && i < job->count && job->offsets[i] < end; i++) {
        Py_ssize_t from = job->offsets[i] > begin ? job->offsets[i] : begin;
        Py_ssize_t to = job->offsets[i + 1] < end ? job->offsets[i + 1] : end;
        int fd = (int)job->files[3 * i];
        off_t at = (off_t)(job->files[3 * i + 1] + (from - job->offsets[i]));
        while (from < to) {
            if (__atomic_load_n(&job->failed, __ATOMIC_RELAXED) >= 0) return; /* another share failed */
            ssize_t got = pread(fd, job->out + from, (size_t)(to - from), at);
            if (got > 0) {
                from += got, at += got;
                continue;
            }
            if (got < 0 && errno == EINTR) continue;
            Py_ssize_t none = -1;
            int code = got < 0 ? errno : 0;
            if (__atomic_compare_exchange_n(&job->failed, &none, i, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
                job->failed_errno = code;
            return;
        }
    }
}

/* Takes a C-contiguous read view of every item of seq into views (released again on failure). */
static int hold_views(PyObject *seq, Py_buffer *views, Py_ssize_t count, const char *what) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &views[i], PyBUF_C_CONTIGUOUS) != 0) {
            PyErr_Format(PyExc_TypeError, "%s: item %zd is not a C-contiguous buffer", what, i);
            for (Py_ssize_t j = 0; j < i; j++) PyBuffer_Release(&views[j]);
            return -1;
        }
    }
    return 0;
}

static void release_views(Py_buffer *views, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

/* gather_into(pieces, out, threads) -> None. pieces: a sequence of C-contiguous buffers; out: a writable
 * C-contiguous buffer exactly as long as all of them together; their bytes are copied into it one after
 * the other, on up to `threads` threads (the calling one included), the GIL released. */
static PyObject *gather_into(PyObject *self, PyObject *args) {
    PyObject *sequence, *seq, *destination;
    Py_buffer out;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOi", &sequence, &destination, &threads)) return NULL;
    if (PyObject_GetBuffer(destination, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_SetString(PyExc_TypeError, "gather_into: out must be a writable C-contiguous buffer");
        return NULL;
    }
    seq = PySequence_Fast(sequence, "gather_into: pieces must be a sequence of buffers");
    if (seq == NULL) {
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    Py_ssize_t *offsets = PyMem_Calloc(count + 1, sizeof(Py_ssize_t));
    if (views == NULL || offsets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (hold_views(seq, views, count, "gather_into: pieces") != 0) goto done;
    for (Py_ssize_t i = 0; i < count; i++) offsets[i + 1] = offsets[i] + views[i].len;
    if (offsets[count] != out.len) {
        PyErr_Format(PyExc_ValueError, "gather_into: the pieces hold %zd bytes, out %zd", offsets[count], out.len);
        release_views(views, count);
        goto done;
    }
    int shares = shares_for(offsets[count], threads);
    gather_job job = {offsets, count, (char *)out.buf, views, NULL, shares == 1 && offsets[count] >= STREAM_MIN_BYTES,
                      -1, 0};
    int ran;
    Py_BEGIN_ALLOW_THREADS
    ran = run_shares(copy_share, &job, shares);
    Py_END_ALLOW_THREADS
    release_views(views, count);
    if (ran != 0) {
        not_waited();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(views);
    PyMem_Free(offsets);
    Py_DECREF(seq);
    PyBuffer_Release(&out);
    return result;
}

/* read_into(files, out, threads) -> None | (piece, errno). files: a C-contiguous int64 buffer of (fd, offset,
 * nbytes) per piece; out: a writable C-contiguous buffer exactly as long as all pieces together; each piece's
 * bytes are read with pread into its place in out, on up to `threads` threads (the calling one included), the
 * GIL released. Returns None, or the first piece that failed and its errno (0: the file ended first), for
 * the caller to name the file. */
static PyObject *read_into(PyObject *self, PyObject *args) {
    PyObject *source, *destination;
    Py_buffer files, out;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOi", &source, &destination, &threads)) return NULL;
    if (PyObject_GetBuffer(source, &files, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return NULL;
    if (files.itemsize != 8 || files.len % 24 != 0) {
        PyErr_SetString(PyExc_TypeError, "read_into: files must be int64 (fd, offset, nbytes) triples");
        PyBuffer_Release(&files);
        return NULL;
    }
    if (PyObject_GetBuffer(destination, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_SetString(PyExc_TypeError, "read_into: out must be a writable C-contiguous buffer");
        PyBuffer_Release(&files);
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t *triples = (const int64_t *)files.buf;
    Py_ssize_t count = files.len / 24;
    Py_ssize_t *offsets = PyMem_Calloc(count + 1, sizeof(Py_ssize_t));
    if (offsets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (triples[3 * i + 1] < 0 || triples[3 * i + 2] < 0) {
            PyErr_Format(PyExc_ValueError, "read_into: piece %zd has a negative offset or size", i);
            goto done;
        }
        offsets[i + 1] = offsets[i] + (Py_ssize_t)triples[3 * i + 2];
    }
    if (offsets[count] != out.len) {
        PyErr_Format(PyExc_ValueError, "read_into: the pieces hold %zd bytes, out %zd", offsets[count], out.len);
        goto done;
    }
    gather_job job = {offsets, count, (char *)out.buf, NULL, triples, 0, -1, 0};
    int shares = shares_for(offsets[count], threads);
    int ran;
    Py_BEGIN_ALLOW_THREADS
    ran = run_shares(read_share, &job, shares);
    Py_END_ALLOW_THREADS
    if (ran != 0) {
        not_waited();
    } else if (job.failed >= 0) {
        result = Py_BuildValue("(ni)", job.failed, job.failed_errno);
    } else {
        result = Py_None;
        Py_INCREF(result);
    }
done:
    PyMem_Free(offsets);
    PyBuffer_Release(&out);
    PyBuffer_Release(&files);
    return result;
}

/* will_need(pieces) -> int: madvise(MADV_WILLNEED) over the pages of each buffer (a slice of a memory-mapped
 * shard) whose first page is not in the page cache, so the kernel reads it in while the batch before it is
 * copied; returns how many were advised. The mincore() check first: WILLNEED walks every page of the range
 * even when all are cached (3.1 us a 196 KB slice here, a third of its copy); the check costs 0.8 us.
 * Advice only: a failure (an anonymous buffer, an old kernel) changes nothing and raises nothing. */
static PyObject *will_need(PyObject *self, PyObject *sequence) {
    (void)self;
    PyObject *seq = PySequence_Fast(sequence, "will_need: pieces must be a sequence of buffers");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    if (hold_views(seq, views, count, "will_need: pieces") != 0) {
        PyMem_Free(views);
        Py_DECREF(seq);
        return NULL;
    }
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    Py_ssize_t advised = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        if (views[i].len == 0) continue;
        uintptr_t first = (uintptr_t)views[i].buf & ~(page - 1);
        uintptr_t end = (uintptr_t)views[i].buf + (uintptr_t)views[i].len;
        unsigned char resident = 0;
        if (mincore((void *)first, page, &resident) == 0 && (resident & 1)) continue;
        (void)madvise((void *)first, end - first, MADV_WILLNEED);
        advised++;
    }
    Py_END_ALLOW_THREADS
    release_views(views, count);
    PyMem_Free(views);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(advised);
}

/* A copy started by gather_start: the pool copies the pieces into out while the caller goes on (building the
 * rest of a batch: its metadata is Python work, ~0.6 ms a batch of 256, a quarter of a 50 MB copy on one
 * core); wait() returns once every byte is in place. Holds the pieces' and out's buffers until then; a job
 * dropped unwaited is waited for by its deallocation (the threads write into out). */
typedef struct {
    PyObject_HEAD
    PyObject *seq;     /* gather_start: the pieces */
    Py_buffer out;
    Py_buffer *views;  /* gather_start: a view of each piece */
    Py_buffer files;   /* read_start: the (fd, offset, nbytes) triples */
    Py_ssize_t *offsets;
    gather_job job;
    int running; /* submitted to the pool, not yet waited for */
    int holding; /* seq, out and views (or files) held */
    int reading; /* read_start's: pread from files, not a copy from views */
} GatherJob;

static void gather_job_finish(GatherJob *self) {
    if (self->running) {
        Py_BEGIN_ALLOW_THREADS
        pool_wait();
        Py_END_ALLOW_THREADS
        self->running = 0;
    }
    if (self->holding) {
        if (self->reading) PyBuffer_Release(&self->files);
        else release_views(self->views, self->job.count);
        PyBuffer_Release(&self->out);
        Py_CLEAR(self->seq);
        self->holding = 0;
    }
    PyMem_Free(self->views);
    PyMem_Free(self->offsets);
    self->views = NULL;
    self->offsets = NULL;
}

/* None; for read_start's job, (piece, errno) of the first piece that failed (0: its file ended first). */
static PyObject *gather_job_wait(GatherJob *self, PyObject *unused) {
    (void)unused;
    gather_job_finish(self);
    if (self->reading && self->job.failed >= 0) return Py_BuildValue("(ni)", self->job.failed, self->job.failed_errno);
    Py_RETURN_NONE;
}

static void gather_job_dealloc(GatherJob *self) {
    gather_job_finish(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef gather_job_methods[] = {
    {"wait", (PyCFunction)gather_job_wait, METH_NOARGS,
     "wait() -> None | (piece, errno): returns once every byte is copied (a read's first failed piece)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GatherJobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shardio.read._gather.GatherJob",
    .tp_basicsize = sizeof(GatherJob),
    .tp_dealloc = (destructor)gather_job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A copy gather_start began; wait() for it.",
    .tp_methods = gather_job_methods,
};

/* A new job, nothing held yet. */
static GatherJob *new_job(int reading) {
    GatherJob *self = PyObject_New(GatherJob, &GatherJobType);
    if (self == NULL) return NULL;
    self->seq = NULL, self->views = NULL, self->offsets = NULL, self->running = 0, self->holding = 0;
    self->reading = reading;
    memset(&self->job, 0, sizeof(self->job));
    self->job.failed = -1;
    return self;
}

/* The job handed to the pool's threads (all of its shares: the caller returns at once), or, where this thread
 * has a started job it has not waited for, refused (RuntimeError) and let go. */
static PyObject *submitted_job(GatherJob *self, share_fn fn, int threads) {
    if (self->offsets[self->job.count] == 0) return (PyObject *)self; /* nothing to copy */
    int shares = shares_for(self->offsets[self->job.count], threads);
    int submitted;
    Py_BEGIN_ALLOW_THREADS
    submitted = pool_submit(fn, &self->job, shares, shares, 1);
    Py_END_ALLOW_THREADS
    if (submitted != 0) {
        Py_DECREF(self);
        return not_waited();
    }
    self->running = 1;
    return (PyObject *)self;
}

/* gather_start(pieces, out, threads) -> GatherJob: what gather_into copies, on up to `threads` threads of the
 * pool (never the calling one, which returns at once); GatherJob.wait() for it before reading out or starting
 * another copy on this thread (which is refused with RuntimeError until then). */
static PyObject *gather_start(PyObject *module, PyObject *args) {
    PyObject *sequence, *destination;
    int threads;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOi", &sequence, &destination, &threads)) return NULL;
    GatherJob *self = new_job(0);
    if (self == NULL) return NULL;
    if (PyObject_GetBuffer(destination, &self->out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_SetString(PyExc_TypeError, "gather_start: out must be a writable C-contiguous buffer");
        Py_DECREF(self);
        return NULL;
    }
    self->seq = PySequence_Fast(sequence, "gather_start: pieces must be a sequence of buffers");
    if (self->seq == NULL) {
        PyBuffer_Release(&self->out);
        Py_DECREF(self);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(self->seq);
    self->views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    self->offsets = PyMem_Calloc(count + 1, sizeof(Py_ssize_t));
    if (self->views == NULL || self->offsets == NULL || hold_views(self->seq, self->views, count, "gather_start: pieces") != 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        PyBuffer_Release(&self->out);
        Py_CLEAR(self->seq);
        Py_DECREF(self);
        return NULL;
    }
    self->holding = 1;
    self->job.count = count;
    for (Py_ssize_t i = 0; i < count; i++) self->offsets[i + 1] = self->offsets[i] + self->views[i].len;
    if (self->offsets[count] != self->out.len) {
        PyErr_Format(PyExc_ValueError, "gather_start: the pieces hold %zd bytes, out %zd", self->offsets[count],
                     self->out.len);
        Py_DECREF(self);
        return NULL;
    }
    gather_job job = {self->offsets, count, (char *)self->out.buf, self->views, NULL,
                      shares_for(self->offsets[count], threads) == 1 && self->offsets[count] >= STREAM_MIN_BYTES,
                      -1, 0};
    self->job = job;
    return submitted_job(self, copy_share, threads);
}

/* read_start(files, out, threads) -> GatherJob: what read_into reads, on up to `threads` threads of the pool
 * (never the calling one); GatherJob.wait() returns read_into's answer. The files must stay open until then. */
static PyObject *read_start(PyObject *module, PyObject *args) {
    PyObject *spans, *destination;
    int threads;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOi", &spans, &destination, &threads)) return NULL;
    GatherJob *self = new_job(1);
    if (self == NULL) return NULL;
    if (PyObject_GetBuffer(spans, &self->files, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        self->reading = 0;
        Py_DECREF(self);
        return NULL;
    }
    if (PyObject_GetBuffer(destination, &self->out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_SetString(PyExc_TypeError, "read_start: out must be a writable C-contiguous buffer");
        PyBuffer_Release(&self->files);
        self->reading = 0;
        Py_DECREF(self);
        return NULL;
    }
    self->holding = 1;
    if (self->files.itemsize != 8 || self->files.len % 24 != 0) {
        PyErr_SetString(PyExc_TypeError, "read_start: files must be int64 (fd, offset, nbytes) triples");
        Py_DECREF(self);
        return NULL;
    }
    Py_ssize_t count = self->files.len / 24;
    const int64_t *triples = (const int64_t *)self->files.buf;
    self->offsets = PyMem_Calloc(count + 1, sizeof(Py_ssize_t));
    if (self->offsets == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (triples[3 * i + 1] < 0 || triples[3 * i + 2] < 0) {
            PyErr_Format(PyExc_ValueError, "read_start: piece %zd has a negative offset or size", i);
            Py_DECREF(self);
            return NULL;
        }
        self->offsets[i + 1] = self->offsets[i] + (Py_ssize_t)triples[3 * i + 2];
    }
    if (self->offsets[count] != self->out.len) {
        PyErr_Format(PyExc_ValueError, "read_start: the pieces hold %zd bytes, out %zd", self->offsets[count],
                     self->out.len);
        Py_DECREF(self);
        return NULL;
    }
    gather_job job = {self->offsets, count, (char *)self->out.buf, NULL, triples, 0, -1, 0};
    self->job = job;
    return submitted_job(self, read_share, threads);
}

static PyMethodDef methods[] = {
    {"read_start", read_start, METH_VARARGS,
     "read_start(files, out, threads) -> GatherJob: read_into on the pool's threads; .wait() for its answer."},
    {"gather_start", gather_start, METH_VARARGS,
     "gather_start(pieces, out, threads) -> GatherJob: gather_into on the pool's threads; .wait() for it."},
    {"gather_into", gather_into, METH_VARARGS,
     "gather_into(pieces, out, threads): copy the buffers' bytes one after the other into out, GIL released."},
    {"read_into", read_into, METH_VARARGS,
     "read_into(files, out, threads) -> None | (piece, errno): pread each (fd, offset, nbytes) into out, GIL released."},
    {"will_need", will_need, METH_O,
     "will_need(pieces) -> int: madvise(MADV_WILLNEED) over each buffer not in the page cache; how many."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gather",
                                    "A batch's slices copied in one native call (shardio.read.gather).", -1,
                                    methods};

/* The yuv420 conversion's functions, added to the module (at the end of this file). */
static int add_yuv420_functions(PyObject *module);

PyMODINIT_FUNC PyInit__gather(void) {
    static int registered = 0;
    if (!registered && pthread_atfork(NULL, NULL, pool_after_fork) == 0) registered = 1;
    if (PyType_Ready(&GatherJobType) < 0) return NULL;
    PyObject *created = PyModule_Create(&module);
    if (created != NULL && add_yuv420_functions(created) != 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}


/* ---- yuv420: a batch's planes converted to RGB (shardio.read.yuv_pixels, shardio.format.yuv_shard) ----
 *
 * yuv420_into(pieces, out, height, width, threads) -> None. pieces: C-contiguous buffers, each holding whole
 * samples' planes (S = H*W + 2*ceil(H/2)*ceil(W/2) bytes a sample: Y, then Cb, then Cr); out: a writable
 * C-contiguous buffer of count*H*W*3 bytes (count: the samples of all pieces). Each sample is converted to
 * RGB: each chroma sample repeated over its 2x2 block, libjpeg's 16-bit fixed-point inverse, clamped; the
 * bytes numpy's shardio.format.yuv_shard.yuv420_to_rgb gives. Samples are split evenly over up to `threads`
 * threads (the caller's included), the GIL released.
 *
 * Speed: per chroma sample the three offsets are computed once (SSE2: 8 at a time), then each Y row adds them
 * to 16 pixels at a time and interleaves R, G, B with SSSE3 byte shuffles (checked at run time; plain C
 * otherwise): ~0.15 ns a pixel from cache on the 2-core dev VM (a 256x256 sample in ~10 us), where the
 * scalar loop took ~3 ns. */
#define YUV_FIX_CR_R 91881   /* 1.40200 * 2^16 */
#define YUV_FIX_CB_B 116130  /* 1.77200 * 2^16 */
#define YUV_FIX_CB_G (-22554) /* -0.34414 * 2^16 */
#define YUV_FIX_CR_G (-46802) /* -0.71414 * 2^16 */
#define YUV_ONE_HALF (1 << 15)
/* Added before the shift so the sum is never negative (C leaves >> of a negative value to the compiler):
 * floor((v + 256 * 2^16) / 2^16) - 256 == floor(v / 2^16) for |v| < 256 * 2^16 (|v| <= 14.9M here). */
#define YUV_BIAS (256 << 16)

static inline uint8_t yuv_clamp(int value) { return value < 0 ? 0 : value > 255 ? 255 : (uint8_t)value; }

/* What each chroma sample of one row adds to Y for R, G and B. */
static void yuv_offsets_scalar(const uint8_t *cb, const uint8_t *cr, int16_t *red, int16_t *green,
                               int16_t *blue, Py_ssize_t from, Py_ssize_t count) {
    for (Py_ssize_t j = from; j < count; j++) {
        int x_cb = (int)cb[j] - 128, x_cr = (int)cr[j] - 128;
        red[j] = (int16_t)(((YUV_FIX_CR_R * x_cr + YUV_ONE_HALF + YUV_BIAS) >> 16) - 256);
        green[j] = (int16_t)(((YUV_FIX_CB_G * x_cb + YUV_FIX_CR_G * x_cr + YUV_ONE_HALF + YUV_BIAS) >> 16) - 256);
        blue[j] = (int16_t)(((YUV_FIX_CB_B * x_cb + YUV_ONE_HALF + YUV_BIAS) >> 16) - 256);
    }
}

/* One output row: Y plus its chroma column's offsets (pixel x takes offsets[x / 2]), clamped. */
static void yuv_row_scalar(const uint8_t *y, const int16_t *red, const int16_t *green, const int16_t *blue,
                           uint8_t *out, Py_ssize_t from, Py_ssize_t width) {
    for (Py_ssize_t x = from; x < width; x++) {
        Py_ssize_t j = x >> 1;
        out[3 * x] = yuv_clamp(y[x] + red[j]);
        out[3 * x + 1] = yuv_clamp(y[x] + green[j]);
        out[3 * x + 2] = yuv_clamp(y[x] + blue[j]);
    }
}

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(SHARDIO_NO_SIMD)
#include <immintrin.h>
#define HAVE_YUV_SIMD 1

/* The same offsets 8 at a time with SSE2 (x86-64's baseline). The constants above 2^15 are split so that
 * _mm_madd_epi16 takes them: 91881 x = 2^16 x + 26345 x, 116130 x = 2^17 x - 14942 x, -46802 x = -2^16 x +
 * 18734 x; floor((2^16 k x + v) / 2^16) = k x + floor(v / 2^16), and the arithmetic shift is the floor. */
static void yuv_offsets_sse2(const uint8_t *cb, const uint8_t *cr, int16_t *red, int16_t *green, int16_t *blue,
                             Py_ssize_t count) {
    const __m128i zero = _mm_setzero_si128(), bias = _mm_set1_epi16(128), two = _mm_set1_epi16(2);
    const __m128i k_red = _mm_setr_epi16(26345, 16384, 26345, 16384, 26345, 16384, 26345, 16384);
    const __m128i k_blue = _mm_setr_epi16(-14942, 16384, -14942, 16384, -14942, 16384, -14942, 16384);
    const __m128i k_green = _mm_setr_epi16(-22554, 18734, -22554, 18734, -22554, 18734, -22554, 18734);
    const __m128i half = _mm_set1_epi32(YUV_ONE_HALF);
    Py_ssize_t j = 0;
    for (; j + 8 <= count; j += 8) {
        __m128i x_cb = _mm_sub_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(cb + j)), zero), bias);
        __m128i x_cr = _mm_sub_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(cr + j)), zero), bias);
        /* (x, 2) . (k, 2^14) = k x + 2^15: the rounding half inside the multiply-add */
        __m128i r_lo = _mm_srai_epi32(_mm_madd_epi16(_mm_unpacklo_epi16(x_cr, two), k_red), 16);
        __m128i r_hi = _mm_srai_epi32(_mm_madd_epi16(_mm_unpackhi_epi16(x_cr, two), k_red), 16);
        __m128i b_lo = _mm_srai_epi32(_mm_madd_epi16(_mm_unpacklo_epi16(x_cb, two), k_blue), 16);
        __m128i b_hi = _mm_srai_epi32(_mm_madd_epi16(_mm_unpackhi_epi16(x_cb, two), k_blue), 16);
        __m128i g_lo = _mm_srai_epi32(
            _mm_add_epi32(_mm_madd_epi16(_mm_unpacklo_epi16(x_cb, x_cr), k_green), half), 16);
        __m128i g_hi = _mm_srai_epi32(
            _mm_add_epi32(_mm_madd_epi16(_mm_unpackhi_epi16(x_cb, x_cr), k_green), half), 16);
        _mm_storeu_si128((__m128i *)(red + j), _mm_add_epi16(_mm_packs_epi32(r_lo, r_hi), x_cr));
        _mm_storeu_si128((__m128i *)(blue + j),
                         _mm_add_epi16(_mm_packs_epi32(b_lo, b_hi), _mm_add_epi16(x_cb, x_cb)));
        _mm_storeu_si128((__m128i *)(green + j), _mm_sub_epi16(_mm_packs_epi32(g_lo, g_hi), x_cr));
    }
    yuv_offsets_scalar(cb, cr, red, green, blue, j, count);
}

/* The same offsets 16 at a time with AVX2: the 16 chroma bytes widened in order, then every step within a
 * 128-bit lane (the unpacks and packs of each lane undo each other: the offsets come out in order). */
__attribute__((target("avx2"))) static void yuv_offsets_avx2(const uint8_t *cb, const uint8_t *cr, int16_t *red,
                                                              int16_t *green, int16_t *blue, Py_ssize_t count) {
    const __m256i bias = _mm256_set1_epi16(128), two = _mm256_set1_epi16(2);
    const __m256i k_red = _mm256_set1_epi32((16384 << 16) | 26345);
    const __m256i k_blue = _mm256_set1_epi32((16384 << 16) | (uint16_t)-14942);
    const __m256i k_green = _mm256_set1_epi32((18734 << 16) | (uint16_t)-22554);
    const __m256i half = _mm256_set1_epi32(YUV_ONE_HALF);
    Py_ssize_t j = 0;
    for (; j + 16 <= count; j += 16) {
        __m256i x_cb = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(cb + j))), bias);
        __m256i x_cr = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(cr + j))), bias);
        __m256i r_lo = _mm256_srai_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi16(x_cr, two), k_red), 16);
        __m256i r_hi = _mm256_srai_epi32(_mm256_madd_epi16(_mm256_unpackhi_epi16(x_cr, two), k_red), 16);
        __m256i b_lo = _mm256_srai_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi16(x_cb, two), k_blue), 16);
        __m256i b_hi = _mm256_srai_epi32(_mm256_madd_epi16(_mm256_unpackhi_epi16(x_cb, two), k_blue), 16);
        __m256i g_lo = _mm256_srai_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi16(x_cb, x_cr), k_green), half), 16);
        __m256i g_hi = _mm256_srai_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpackhi_epi16(x_cb, x_cr), k_green), half), 16);
        _mm256_storeu_si256((__m256i *)(red + j), _mm256_add_epi16(_mm256_packs_epi32(r_lo, r_hi), x_cr));
        _mm256_storeu_si256((__m256i *)(blue + j),
                            _mm256_add_epi16(_mm256_packs_epi32(b_lo, b_hi), _mm256_add_epi16(x_cb, x_cb)));
        _mm256_storeu_si256((__m256i *)(green + j), _mm256_sub_epi16(_mm256_packs_epi32(g_lo, g_hi), x_cr));
    }
    if (j < count) yuv_offsets_sse2(cb + j, cr + j, red + j, green + j, blue + j, count - j);
}

/* 16 pixels at a time: Y widened to 16 bits plus each offset repeated twice, packed back with unsigned
 * saturation (the clamp), then R, G, B interleaved into 48 bytes with byte shuffles. */
__attribute__((target("ssse3"))) static void yuv_row_ssse3(const uint8_t *y, const int16_t *red,
                                                            const int16_t *green, const int16_t *blue,
                                                            uint8_t *out, Py_ssize_t width) {
    const __m128i zero = _mm_setzero_si128();
    const __m128i r0 = _mm_setr_epi8(0, -1, -1, 1, -1, -1, 2, -1, -1, 3, -1, -1, 4, -1, -1, 5);
    const __m128i g0 = _mm_setr_epi8(-1, 0, -1, -1, 1, -1, -1, 2, -1, -1, 3, -1, -1, 4, -1, -1);
    const __m128i b0 = _mm_setr_epi8(-1, -1, 0, -1, -1, 1, -1, -1, 2, -1, -1, 3, -1, -1, 4, -1);
    const __m128i r1 = _mm_setr_epi8(-1, -1, 6, -1, -1, 7, -1, -1, 8, -1, -1, 9, -1, -1, 10, -1);
    const __m128i g1 = _mm_setr_epi8(5, -1, -1, 6, -1, -1, 7, -1, -1, 8, -1, -1, 9, -1, -1, 10);
    const __m128i b1 = _mm_setr_epi8(-1, 5, -1, -1, 6, -1, -1, 7, -1, -1, 8, -1, -1, 9, -1, -1);
    const __m128i r2 = _mm_setr_epi8(-1, 11, -1, -1, 12, -1, -1, 13, -1, -1, 14, -1, -1, 15, -1, -1);
    const __m128i g2 = _mm_setr_epi8(-1, -1, 11, -1, -1, 12, -1, -1, 13, -1, -1, 14, -1, -1, 15, -1);
    const __m128i b2 = _mm_setr_epi8(10, -1, -1, 11, -1, -1, 12, -1, -1, 13, -1, -1, 14, -1, -1, 15);
    Py_ssize_t x = 0;
    for (; x + 16 <= width; x += 16) {
        __m128i luma = _mm_loadu_si128((const __m128i *)(y + x));
        __m128i low = _mm_unpacklo_epi8(luma, zero), high = _mm_unpackhi_epi8(luma, zero);
        __m128i r = _mm_loadu_si128((const __m128i *)(red + x / 2));
        __m128i g = _mm_loadu_si128((const __m128i *)(green + x / 2));
        __m128i b = _mm_loadu_si128((const __m128i *)(blue + x / 2));
        __m128i R = _mm_packus_epi16(_mm_add_epi16(low, _mm_unpacklo_epi16(r, r)),
                                     _mm_add_epi16(high, _mm_unpackhi_epi16(r, r)));
        __m128i G = _mm_packus_epi16(_mm_add_epi16(low, _mm_unpacklo_epi16(g, g)),
                                     _mm_add_epi16(high, _mm_unpackhi_epi16(g, g)));
        __m128i B = _mm_packus_epi16(_mm_add_epi16(low, _mm_unpacklo_epi16(b, b)),
                                     _mm_add_epi16(high, _mm_unpackhi_epi16(b, b)));
        _mm_storeu_si128((__m128i *)(out + 3 * x), _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(R, r0),
                                                    _mm_shuffle_epi8(G, g0)), _mm_shuffle_epi8(B, b0)));
        _mm_storeu_si128((__m128i *)(out + 3 * x + 16), _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(R, r1),
                                                         _mm_shuffle_epi8(G, g1)), _mm_shuffle_epi8(B, b1)));
        _mm_storeu_si128((__m128i *)(out + 3 * x + 32), _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(R, r2),
                                                         _mm_shuffle_epi8(G, g2)), _mm_shuffle_epi8(B, b2)));
    }
    yuv_row_scalar(y, red, green, blue, out, x, width);
}

/* The same 32 pixels at a time with AVX2: every step of the SSSE3 row stays within a 128-bit lane, so lane 0
 * does pixels 0-15 and lane 1 pixels 16-31 with the same shuffles, and each lane's 48 bytes are stored as
 * three 16-byte halves. `stream`: the stores bypass the cache (a batch larger than it, written once: no
 * read of the line it overwrites, as copy_streaming does for raw batches); out must then be 16-aligned. */
__attribute__((target("avx2"))) static void yuv_row_avx2(const uint8_t *y, const int16_t *red,
                                                          const int16_t *green, const int16_t *blue,
                                                          uint8_t *out, Py_ssize_t width, int stream) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i r0 = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, -1, -1, 1, -1, -1, 2, -1, -1, 3, -1, -1, 4, -1, -1, 5));
    const __m256i g0 = _mm256_broadcastsi128_si256(_mm_setr_epi8(-1, 0, -1, -1, 1, -1, -1, 2, -1, -1, 3, -1, -1, 4, -1, -1));
    const __m256i b0 = _mm256_broadcastsi128_si256(_mm_setr_epi8(-1, -1, 0, -1, -1, 1, -1, -1, 2, -1, -1, 3, -1, -1, 4, -1));
    const __m256i r1 = _mm256_broadcastsi128_si256(_mm_setr_epi8(-1, -1, 6, -1, -1, 7, -1, -1, 8, -1, -1, 9, -1, -1, 10, -1));
    const __m256i g1 = _mm256_broadcastsi128_si256(_mm_setr_epi8(5, -1, -1, 6, -1, -1, 7, -1, -1, 8, -1, -1, 9, -1, -1, 10));
    const __m256i b1 = _mm256_broadcastsi128_si256(_mm_setr_epi8(-1, 5, -1, -1, 6, -1, -1, 7, -1, -1, 8, -1, -1, 9, -1, -1));
    const __m256i r2 = _mm256_broadcastsi128_si256(_mm_setr_epi8(-1, 11, -1, -1, 12, -1, -1, 13, -1, -1, 14, -1, -1, 15, -1, -1));
    const __m256i g2 = _mm256_broadcastsi128_si256(_mm_setr_epi8(-1, -1, 11, -1, -1, 12, -1, -1, 13, -1, -1, 14, -1, -1, 15, -1));
    const __m256i b2 = _mm256_broadcastsi128_si256(_mm_setr_epi8(10, -1, -1, 11, -1, -1, 12, -1, -1, 13, -1, -1, 14, -1, -1, 15));
    Py_ssize_t x = 0;
    for (; x + 32 <= width; x += 32) {
        __m256i luma = _mm256_loadu_si256((const __m256i *)(y + x));
        __m256i low = _mm256_unpacklo_epi8(luma, zero), high = _mm256_unpackhi_epi8(luma, zero);
        __m256i r = _mm256_loadu_si256((const __m256i *)(red + x / 2));
        __m256i g = _mm256_loadu_si256((const __m256i *)(green + x / 2));
        __m256i b = _mm256_loadu_si256((const __m256i *)(blue + x / 2));
        __m256i R = _mm256_packus_epi16(_mm256_add_epi16(low, _mm256_unpacklo_epi16(r, r)),
                                        _mm256_add_epi16(high, _mm256_unpackhi_epi16(r, r)));
        __m256i G = _mm256_packus_epi16(_mm256_add_epi16(low, _mm256_unpacklo_epi16(g, g)),
                                        _mm256_add_epi16(high, _mm256_unpackhi_epi16(g, g)));
        __m256i B = _mm256_packus_epi16(_mm256_add_epi16(low, _mm256_unpacklo_epi16(b, b)),
                                        _mm256_add_epi16(high, _mm256_unpackhi_epi16(b, b)));
        __m256i o0 = _mm256_or_si256(_mm256_or_si256(_mm256_shuffle_epi8(R, r0), _mm256_shuffle_epi8(G, g0)),
                                     _mm256_shuffle_epi8(B, b0));
        __m256i o1 = _mm256_or_si256(_mm256_or_si256(_mm256_shuffle_epi8(R, r1), _mm256_shuffle_epi8(G, g1)),
                                     _mm256_shuffle_epi8(B, b1));
        __m256i o2 = _mm256_or_si256(_mm256_or_si256(_mm256_shuffle_epi8(R, r2), _mm256_shuffle_epi8(G, g2)),
                                     _mm256_shuffle_epi8(B, b2));
        __m128i *to = (__m128i *)(out + 3 * x);
        __m128i parts[6] = {_mm256_castsi256_si128(o0), _mm256_castsi256_si128(o1), _mm256_castsi256_si128(o2),
                            _mm256_extracti128_si256(o0, 1), _mm256_extracti128_si256(o1, 1),
                            _mm256_extracti128_si256(o2, 1)};
        if (stream) {
            for (int k = 0; k < 6; k++) _mm_stream_si128(to + k, parts[k]);
        } else {
            for (int k = 0; k < 6; k++) _mm_storeu_si128(to + k, parts[k]);
        }
    }
    if (x < width) yuv_row_ssse3(y + x, red + x / 2, green + x / 2, blue + x / 2, out + 3 * x, width - x);
}
#endif

static int yuv_have_ssse3 = 0, yuv_have_avx2 = 0; /* set once at import */

typedef struct {
    const uint8_t **samples; /* each sample's planes */
    uint8_t *out;
    Py_ssize_t height, width, begin, end; /* this thread's samples [begin, end) */
    int16_t *scratch;                     /* 3 * (CW + 16) offsets */
    int stream;                           /* streaming stores (a batch larger than the cache) */
} yuv_share;

static void *yuv_convert_share(void *arg) {
    yuv_share *share = (yuv_share *)arg;
    Py_ssize_t height = share->height, width = share->width;
    Py_ssize_t chroma_h = (height + 1) / 2, chroma_w = (width + 1) / 2, stride = chroma_w + 16;
    int16_t *red = share->scratch, *green = red + stride, *blue = green + stride;
    for (Py_ssize_t n = share->begin; n < share->end; n++) {
        const uint8_t *luma = share->samples[n];
        const uint8_t *cb = luma + height * width, *cr = cb + chroma_h * chroma_w;
        uint8_t *out = share->out + n * height * width * 3;
        for (Py_ssize_t cy = 0; cy < chroma_h; cy++) {
#ifdef HAVE_YUV_SIMD
            if (yuv_have_avx2) yuv_offsets_avx2(cb + cy * chroma_w, cr + cy * chroma_w, red, green, blue, chroma_w);
            else yuv_offsets_sse2(cb + cy * chroma_w, cr + cy * chroma_w, red, green, blue, chroma_w);
#else
            yuv_offsets_scalar(cb + cy * chroma_w, cr + cy * chroma_w, red, green, blue, 0, chroma_w);
#endif
            for (Py_ssize_t row = 2 * cy; row < 2 * cy + 2 && row < height; row++) {
                uint8_t *to = out + row * width * 3;
#ifdef HAVE_YUV_SIMD
                if (yuv_have_avx2) {
                    yuv_row_avx2(luma + row * width, red, green, blue, to, width,
                                 share->stream && ((uintptr_t)to & 15) == 0);
                    continue;
                }
                if (yuv_have_ssse3) {
                    yuv_row_ssse3(luma + row * width, red, green, blue, to, width);
                    continue;
                }
#endif
                yuv_row_scalar(luma + row * width, red, green, blue, to, 0, width);
            }
        }
    }
#ifdef HAVE_YUV_SIMD
    if (share->stream) _mm_sfence(); /* streaming stores are weakly ordered: visible before the batch is read */
#endif
    return NULL;
}

static PyObject *yuv420_into(PyObject *self, PyObject *args) {
    PyObject *sequence, *seq, *destination;
    Py_buffer out;
    Py_ssize_t height, width;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnni", &sequence, &destination, &height, &width, &threads)) return NULL;
    if (height < 1 || width < 1) {
        PyErr_Format(PyExc_ValueError, "yuv420_into: height and width must be >= 1, got %zd x %zd", height, width);
        return NULL;
    }
    if (PyObject_GetBuffer(destination, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_SetString(PyExc_TypeError, "yuv420_into: out must be a writable C-contiguous buffer");
        return NULL;
    }
    seq = PySequence_Fast(sequence, "yuv420_into: pieces must be a sequence of buffers");
    if (seq == NULL) {
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), held = 0, samples = 0;
    Py_ssize_t sample_bytes = height * width + 2 * ((height + 1) / 2) * ((width + 1) / 2);
    Py_buffer *views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    const uint8_t **starts = NULL;
    int16_t *scratch = NULL;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (hold_views(seq, views, count, "yuv420_into: pieces") != 0) goto done;
    held = count;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (views[i].len % sample_bytes != 0) {
            PyErr_Format(PyExc_ValueError, "yuv420_into: piece %zd holds %zd bytes, not whole samples of %zd "
                         "(%zd x %zd)", i, views[i].len, sample_bytes, height, width);
            goto done;
        }
        samples += views[i].len / sample_bytes;
    }
    if (out.len != samples * height * width * 3) {
        PyErr_Format(PyExc_ValueError, "yuv420_into: the pieces hold %zd samples of %zd x %zd, out %zd bytes",
                     samples, height, width, out.len);
        goto done;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (samples < threads) threads = samples < 1 ? 1 : (int)samples;
    Py_ssize_t stride = (width + 1) / 2 + 16;
    starts = PyMem_Malloc((samples ? samples : 1) * sizeof(uint8_t *));
    scratch = PyMem_Malloc((size_t)threads * 3 * stride * sizeof(int16_t));
    if (starts == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0, n = 0; i < count; i++)
        for (Py_ssize_t at = 0; at < views[i].len; at += sample_bytes) starts[n++] = (const uint8_t *)views[i].buf + at;
    yuv_share shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        shares[t] = (yuv_share){starts, (uint8_t *)out.buf, height, width, samples * t / threads,
                                samples * (t + 1) / threads, scratch + (Py_ssize_t)t * 3 * stride,
                                out.len >= STREAM_MIN_BYTES};
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[started], NULL, yuv_convert_share, &shares[t]) == 0) started++;
        else yuv_convert_share(&shares[t]);
    }
    yuv_convert_share(&shares[0]);
    for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release_views(views, held);
    PyMem_Free(views);
    PyMem_Free(starts);
    PyMem_Free(scratch);
    Py_DECREF(seq);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *yuv420_simd(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(yuv_have_avx2 ? "avx2" : yuv_have_ssse3 ? "ssse3" : "scalar");
}

static PyMethodDef yuv420_methods[] = {
    {"yuv420_into", yuv420_into, METH_VARARGS,
     "yuv420_into(pieces, out, height, width, threads): samples' yuv420 planes converted to RGB into out."},
    {"yuv420_simd", yuv420_simd, METH_NOARGS, "yuv420_simd() -> str: the row conversion in use (avx2, ssse3, scalar)."},
    {NULL, NULL, 0, NULL},
};

static int add_yuv420_functions(PyObject *module) {
#ifdef HAVE_YUV_SIMD
    __builtin_cpu_init();
    yuv_have_ssse3 = getenv("SHARDIO_YUV_NO_SIMD") == NULL && __builtin_cpu_supports("ssse3");
    yuv_have_avx2 = yuv_have_ssse3 && getenv("SHARDIO_YUV_NO_AVX2") == NULL && __builtin_cpu_supports("avx2");
#endif
    return PyModule_AddFunctions(module, yuv420_methods);
}
