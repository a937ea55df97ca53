/* shardio.read._gather: copy a batch's slices of memory-mapped shards into one buffer in one native call,
 * with the GIL released; and ask the kernel to read ahead the slices of a batch still to come.
 *
 * Why: with the default shuffle (blocks of 1) a batch of 256 is 256 slices of 256 different places in the
 * shards. torch.cat over 256 tensors spread the copy over torch's OpenMP threads, which on a machine whose
 * cores are busy (the training loop's own copy, the step) wait for each other: 0.18 of np.copyto against
 * 0.96 sequential (bench.reader). Here the slices' bytes are split evenly over a few plain threads (the
 * caller says how many; one copies with streaming stores, see copy_streaming); nothing spins, and the
 * training loop's thread runs meanwhile.
 *
 * Optional, like the other extensions (setup.py): without it shardio.read.gather copies with numpy, the
 * same bytes in the same places.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(SHARDIO_NO_STREAM)
#include <emmintrin.h>
#define HAVE_STREAM 1
#endif

/* Threads never get less than this much to copy: a thread's start costs ~20-50 us, 4 MB ~0.3-0.6 ms. */
#define MIN_BYTES_PER_THREAD (4 << 20)
/* Batches from this size on, copied on one thread, are written with streaming stores (copy_streaming);
 * smaller ones stay in the cache for whoever reads them next (a 64x64 batch of 256 is 3 MB). */
#define STREAM_MIN_BYTES (8 << 20)
#define MAX_THREADS 64

typedef struct {
    Py_buffer *views;      /* the slices, in batch order */
    Py_ssize_t *offsets;   /* where each slice starts in out; offsets[count] is the total */
    Py_ssize_t count;
    char *out;
    int stream;            /* streaming stores (a batch larger than the cache) */
} gather_job;

typedef struct {
    gather_job *job;
    Py_ssize_t begin, end; /* this thread's bytes of out */
} gather_share;

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

/* Copies out[begin:end) from the slices that hold those bytes. */
static void *copy_share(void *arg) {
    gather_share *share = (gather_share *)arg;
    gather_job *job = share->job;
    Py_ssize_t begin = share->begin, end = share->end;
    if (begin >= end) return NULL;
    /* The first slice ending after begin (binary search: slices are in order). */
    Py_ssize_t low = 0, high = job->count - 1;
    while (low < high) {
        Py_ssize_t mid = low + (high - low) / 2;
        if (job->offsets[mid + 1] <= begin) low = mid + 1;
        else high = mid;
    }
    for (Py_ssize_t i = low; i < job->count && job->offsets[i] < end; i++) {
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
    return NULL;
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
    Py_ssize_t total = offsets[count];
    Py_ssize_t wanted = total / MIN_BYTES_PER_THREAD;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (wanted < threads) threads = wanted < 1 ? 1 : (int)wanted;
    gather_job job = {views, offsets, count, (char *)out.buf, threads == 1 && total >= STREAM_MIN_BYTES};
    gather_share shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        shares[t].job = &job;
        shares[t].begin = total / threads * t;
        shares[t].end = t == threads - 1 ? total : total / threads * (t + 1);
    }
    /* Share 0 is the calling thread's; a thread that cannot start leaves its share to the caller. */
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[started], NULL, copy_share, &shares[t]) == 0) started++;
        else copy_share(&shares[t]);
    }
    copy_share(&shares[0]);
    for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
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
    {"will_need", will_need, METH_O,
     "will_need(pieces) -> int: madvise(MADV_WILLNEED) over each buffer not in the page cache; how many."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gather",
                                    "A batch's slices copied in one native call (shardio.read.gather).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__gather(void) { return PyModule_Create(&module); }

