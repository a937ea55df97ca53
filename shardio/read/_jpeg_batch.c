/* shardio.read._jpeg_batch: decode a batch of same-size JPEGs into one N x H x W x 3 buffer on a native thread
 * pool, with the GIL released. (The job encodes with Pillow: the same libjpeg-turbo calls, byte for byte
 * the same files, as fast: 0.23-0.29 ms for a 256x256 image here.) Optional: built where a C
 * compiler and the libjpeg-turbo headers exist (setup.py); shardio.read.jpeg_decode says what to install
 * when a JPEG dataset is opened without it.
 *
 * Decoder settings are libjpeg's defaults (ISLOW DCT, fancy upsampling, output JCS_RGB): the most
 * accurate, and what Pillow and PIL-based readers give for the same bytes. Any libjpeg warning (corrupt
 * data it would resynchronise after or fill with grey) is an error here: the job writes clean JPEGs, so a
 * warning means the shard was damaged, and a silently grey sample must never reach training.
 *
 * Threads take the next sample from an atomic counter (samples differ in entropy-coded size, so a fixed
 * split would leave cores idle). The first failing sample (lowest index) is reported; the rest of the
 * batch is still decoded, which is harmless: the caller raises.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} batch_error;

static void error_exit(j_common_ptr cinfo) {
    batch_error *err = (batch_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void emit_message(j_common_ptr cinfo, int level) {
    if (level < 0) error_exit(cinfo); /* a warning: corrupt data, see the file comment */
}

static void output_message(j_common_ptr cinfo) { (void)cinfo; }

typedef struct {
    Py_buffer *views;      /* one per sample: its JPEG bytes */
    unsigned char *out;    /* N x H x W x 3 */
    Py_ssize_t count;
    int height, width;
    Py_ssize_t next;       /* the next sample to take (atomic) */
    Py_ssize_t failed;     /* lowest failing sample, or count (guarded by lock) */
    char message[JMSG_LENGTH_MAX + 64];
    pthread_mutex_t lock;
} batch_job;

/* 0 on success, else writes why into message. */
static int decode_one(const unsigned char *data, size_t len, unsigned char *out, int height, int width,
                      char *message, size_t message_len) {
    struct jpeg_decompress_struct cinfo;
    batch_error err;
    memset(&cinfo, 0, sizeof(cinfo));
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = error_exit;
    err.pub.emit_message = emit_message;
    err.pub.output_message = output_message;
    err.message[0] = 0;
    if (setjmp(err.jump)) {
        snprintf(message, message_len, "corrupt JPEG (%s)", err.message);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    if (len == 0) {
        snprintf(message, message_len, "empty JPEG (0 bytes)");
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_mem_src(&cinfo, data, (unsigned long)len);
    jpeg_read_header(&cinfo, TRUE);
    if ((int)cinfo.image_width != width || (int)cinfo.image_height != height || cinfo.num_components != 3) {
        snprintf(message, message_len, "JPEG is %ux%u with %d components, the dataset's images are %dx%d RGB",
                 cinfo.image_width, cinfo.image_height, cinfo.num_components, width, height);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    jpeg_start_decompress(&cinfo);
    size_t stride = (size_t)width * 3;
    while (cinfo.output_scanline < cinfo.output_height) {
        JSAMPROW row = out + (size_t)cinfo.output_scanline * stride;
        if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
            snprintf(message, message_len, "JPEG data ended at row %u of %d", cinfo.output_scanline, height);
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
    }
    jpeg_finish_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

static void *decode_worker(void *arg) {
    batch_job *job = (batch_job *)arg;
    char message[JMSG_LENGTH_MAX + 64];
    size_t image_bytes = (size_t)job->height * job->width * 3;
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->count) break;
        Py_buffer *view = &job->views[i];
        if (decode_one((const unsigned char *)view->buf, (size_t)view->len, job->out + (size_t)i * image_bytes,
                       job->height, job->width, message, sizeof(message)) != 0) {
            pthread_mutex_lock(&job->lock);
            if (i < job->failed) {
                job->failed = i;
                memcpy(job->message, message, sizeof(message));
            }
            pthread_mutex_unlock(&job->lock);
        }
    }
    return NULL;
}

/* decode_into(jpegs, out, height, width, threads) -> None, or (index, message) of the first bad sample.
 * jpegs: a sequence of bytes-like objects; out: a writable C-contiguous buffer of len(jpegs) x H x W x 3. */
static PyObject *decode_into(PyObject *self, PyObject *args) {
    PyObject *sequence, *seq = NULL, *result = NULL;
    Py_buffer out;
    int height, width, threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ow*iii", &sequence, &out, &height, &width, &threads)) return NULL;
    seq = PySequence_Fast(sequence, "decode_into: jpegs must be a sequence of bytes-like objects");
    if (seq == NULL) {
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (height < 1 || width < 1 || out.len != count * (Py_ssize_t)height * width * 3) {
        PyErr_Format(PyExc_ValueError, "decode_into: out holds %zd bytes, %zd images of %dx%dx3 need %zd",
                     out.len, count, height, width, count * (Py_ssize_t)height * width * 3);
        goto done;
    }
    Py_buffer *views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t held = 0;
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &views[held], PyBUF_SIMPLE) != 0) break;
    }
    if (held == count) {
        batch_job job;
        memset(&job, 0, sizeof(job));
        job.views = views;
        job.out = (unsigned char *)out.buf;
        job.count = count;
        job.height = height;
        job.width = width;
        job.failed = count;
        pthread_mutex_init(&job.lock, NULL);
        if (threads < 1) threads = 1;
        if (threads > count) threads = count > 0 ? (int)count : 1;
        pthread_t *ids = malloc(sizeof(pthread_t) * (size_t)threads);
        Py_BEGIN_ALLOW_THREADS
        int started = 0;
        /* The calling thread works too: threads - 1 helpers. */
        for (int t = 1; ids != NULL && t < threads; t++) {
            if (pthread_create(&ids[started], NULL, decode_worker, &job) == 0) started++;
        }
        decode_worker(&job);
        for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
        Py_END_ALLOW_THREADS
        free(ids);
        pthread_mutex_destroy(&job.lock);
        if (job.failed < count)
            result = Py_BuildValue("(ns)", job.failed, job.message);
        else
            result = Py_NewRef(Py_None);
    }
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_into", decode_into, METH_VARARGS,
     "decode_into(jpegs, out, height, width, threads) -> None or (index, message) of the first bad sample"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "shardio.read._jpeg_batch", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg_batch(void) { return PyModule_Create(&module); }
