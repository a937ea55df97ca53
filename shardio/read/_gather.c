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
 * turn, its GIL released); the calling thread takes shares too, and any share no thread took. A forked child (a DataLoader
 * worker) has none of the parent's threads: pthread_atfork empties the pool there, and the child starts its
 * own on its first batch. */
typedef void (*share_fn)(void *job, int share, int shares);

static struct {
    pthread_mutex_t lock;      /* the fields below */
    pthread_cond_t start;      /* a new job (generation moved on) */
    pthread_cond_t finished;   /* remaining reached 0 */
    pthread_mutex_t turn;      /* held by the one caller whose job runs */
    int size;                  /* worker threads started */
    unsigned long generation;
    share_fn fn;
    void *job;
    int shares, next_share, remaining;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_MUTEX_INITIALIZER, 0, 0, NULL, NULL, 0, 0, 0};

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
    pool.turn = fresh;
    pool.start = cond;
    pool.finished = cond;
    pool.size = 0;
    pool.shares = pool.next_share = pool.remaining = 0;
}

/* fn(job, s, shares) for s in 0..shares-1 on up to `shares` threads (the caller's included), returning when
 * all are done. Without the GIL. */
static void run_shares(share_fn fn, void *job, int shares) {
    if (shares <= 1) {
        fn(job, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.turn);
    pthread_mutex_lock(&pool.lock);
    while (pool.size < shares - 1 && pool.size < MAX_THREADS - 1) {
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
    take_shares();
    while (pool.remaining > 0) pthread_cond_wait(&pool.finished, &pool.lock);
    pool.shares = 0;
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.turn);
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
    Py_BEGIN_ALLOW_THREADS
    run_shares(copy_share, &job, shares);
    Py_END_ALLOW_THREADS
    release_views(views, count);
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
    Py_BEGIN_ALLOW_THREADS
    run_shares(read_share, &job, shares);
    Py_END_ALLOW_THREADS
    if (job.failed >= 0) {
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

static PyMethodDef methods[] = {
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

PyMODINIT_FUNC PyInit__gather(void) {
    static int registered = 0;
    if (!registered && pthread_atfork(NULL, NULL, pool_after_fork) == 0) registered = 1;
    return PyModule_Create(&module);
}

