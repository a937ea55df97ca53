/* Decode the part of a JPEG that a resize will read: libjpeg-turbo's DCT scaling, then only the columns
 * (jpeg_crop_scanline) and rows (jpeg_skip_scanlines) of a region, straight into RGBX rows that Pillow
 * maps without a copy. See preprocess/image/jpeg_region.py for why and for the Python side.
 *
 * Decoder settings are Pillow's for a drafted JPEG (JpegDecode.c with decoderconfig (scale, 0)): the
 * colour space libjpeg reads from the markers, ISLOW DCT, fancy upsampling, output JCS_EXT_RGBX; so the
 * pixels inside the region are the ones Pillow's draft + load gives, at the same place. Rows below the region are still
 * entropy-decoded (skipped, not read past), so truncated data is found wherever it is.
 *
 * The data source is Pillow's strict one (jpeg_markers._StrictJpegDecoder) without suspension: the bytes
 * up to the held-back EOI, then 8 zero bytes (libjpeg-turbo's Huffman read-ahead), then the EOI. A scan
 * that still needs bits when it meets a marker ("premature end of data segment", JWRN_HIT_MARKER) was cut
 * there: ScanDataEnded, when the marker is that final EOI or a stray one (FF 01, a reserved code, a restart
 * marker in a scan without restart interval; jpeg_markers' rule). libjpeg would fill the rest of the image
 * with grey, skip the bytes after the marker as "extraneous data" and finish. A scan short of data before
 * the next segment or restart marker is local damage that libjpeg resynchronises after; it is ignored, as
 * on Pillow's path, where every libjpeg warning is.
 *
 * No loop here can run forever: each read must return its row and each skip land where asked (else an
 * error), and a multi-scan JPEG, whose data jpeg_start_decompress has already read to the EOI, stops after
 * the region. Skipping its rows below the region once never returned (libjpeg-turbo 2.1.5, progressive
 * 2x4 sampling: jdcoefct.c's decompress_data waits for input rows that the EOI will never bring; upstream
 * issue #237 is the same loop).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#if !defined(JCS_EXTENSIONS)
#error "libjpeg-turbo with JCS_EXTENSIONS is required"
#endif

static PyObject *ScanDataEnded; /* set at import: preprocess.image.jpeg_markers.ScanDataEnded */

static const JOCTET FILLER[8] = {0, 0, 0, 0, 0, 0, 0, 0};
static const JOCTET EOI[2] = {0xFF, 0xD9};

typedef struct {
    struct jpeg_source_mgr pub;
    int phase; /* 0: data delivered, 1: filler delivered, 2+: EOI delivered */
} region_source;

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int cut;                            /* a scan met the final EOI still needing data */
    char message[JMSG_LENGTH_MAX];
} region_error;

static void init_source(j_decompress_ptr cinfo) { (void)cinfo; }
static void term_source(j_decompress_ptr cinfo) { (void)cinfo; }

static boolean fill_input_buffer(j_decompress_ptr cinfo) {
    region_source *src = (region_source *)cinfo->src;
    if (src->phase == 0) {
        src->pub.next_input_byte = FILLER;
        src->pub.bytes_in_buffer = sizeof(FILLER);
    } else {
        src->pub.next_input_byte = EOI;
        src->pub.bytes_in_buffer = sizeof(EOI);
    }
    src->phase++;
    return TRUE;
}

static void skip_input_data(j_decompress_ptr cinfo, long count) {
    region_source *src = (region_source *)cinfo->src;
    while (count > (long)src->pub.bytes_in_buffer) {
        count -= (long)src->pub.bytes_in_buffer;
        fill_input_buffer(cinfo);
    }
    src->pub.next_input_byte += count;
    src->pub.bytes_in_buffer -= (size_t)count;
}

static void error_exit(j_common_ptr cinfo) {
    region_error *err = (region_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Whether a scan's data may end at this marker (jpeg_markers._AFTER_SCAN): the next segment's marker, or
 * a restart marker in a scan with a restart interval. Not the EOI: the data up to it was cut. */
static int ends_a_scan(j_decompress_ptr cinfo, int marker) {
    if (marker >= 0xD0 && marker <= 0xD7) return cinfo->restart_interval != 0;
    return marker == 0xC4 || marker == 0xCC || marker == 0xDA || marker == 0xDB || marker == 0xDC ||
           marker == 0xDD || marker == 0xFE || (marker >= 0xE0 && marker <= 0xEF);
}

static void emit_message(j_common_ptr cinfo, int level) {
    region_error *err = (region_error *)cinfo->err;
    j_decompress_ptr dinfo = (j_decompress_ptr)cinfo;
    /* level -1: a warning. A scan cut by the EOI or a stray marker; see the file comment. */
    if (level < 0 && cinfo->err->msg_code == JWRN_HIT_MARKER && !ends_a_scan(dinfo, dinfo->unread_marker))
        err->cut = 1;
}

static void output_message(j_common_ptr cinfo) { (void)cinfo; }

/* decode_region(data, end, scale, W, H, x0, x1, y0, y1) -> (pixels, W, H, x, width, y, height)
 *
 * data[:end] is the JPEG up to (not including) its EOI; scale the DCT scale denominator (1, 2, 4, 8);
 * W x H the scaled size the caller expects (its limits were checked on it: any other is an error).
 * [x0, x1) x [y0, y1) is the region wanted, in scaled output pixels. pixels holds W x H RGBX pixels (the
 * whole scaled image) of which only the region decoded is written: [x, x + width) x [y, y + height),
 * which contains the one asked for (its left edge moves down to an iMCU boundary). */
static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t end;
    int scale, expected_width, expected_height, x0, x1, y0, y1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*niiiiiii", &view, &end, &scale, &expected_width, &expected_height, &x0,
                          &x1, &y0, &y1))
        return NULL;
    if (end < 0 || end > view.len || !(scale == 1 || scale == 2 || scale == 4 || scale == 8) ||
        x0 < 0 || y0 < 0 || x1 <= x0 || y1 <= y0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "decode_region: bad arguments");
        return NULL;
    }

    struct jpeg_decompress_struct cinfo;
    region_error err;
    region_source src;
    PyObject *volatile pixels = NULL;
    JSAMPROW volatile scratch = NULL;
    PyThreadState *volatile released = NULL;
    JDIMENSION xoffset = 0, width = 0, rows_from = 0, rows = 0, cinfo_width = 0, cinfo_height = 0;
    int failed = 0;

    memset(&cinfo, 0, sizeof(cinfo));
    memset(&src, 0, sizeof(src));
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = error_exit;
    err.pub.emit_message = emit_message;
    err.pub.output_message = output_message;
    err.cut = 0;
    err.message[0] = '\0';

    if (setjmp(err.jump)) {
        failed = 1;
        goto done;
    }
    jpeg_create_decompress(&cinfo);
    src.pub.init_source = init_source;
    src.pub.fill_input_buffer = fill_input_buffer;
    src.pub.skip_input_data = skip_input_data;
    src.pub.resync_to_restart = jpeg_resync_to_restart;
    src.pub.term_source = term_source;
    src.pub.next_input_byte = (const JOCTET *)view.buf;
    src.pub.bytes_in_buffer = (size_t)end;
    cinfo.src = &src.pub;

    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.num_components != 1 && cinfo.num_components != 3) {
        strcpy(err.message, "decode_region: only 1- or 3-component JPEGs");
        failed = 2;
        goto done;
    }
    cinfo.out_color_space = JCS_EXT_RGBX;
    if (scale > 1) {
        cinfo.scale_num = 1;
        cinfo.scale_denom = (unsigned int)scale;
    }
    /* The size limits were checked on Pillow's reading of the header: libjpeg must read the same size. */
    jpeg_calc_output_dimensions(&cinfo);
    if (cinfo.output_width != (JDIMENSION)expected_width || cinfo.output_height != (JDIMENSION)expected_height) {
        snprintf(err.message, sizeof(err.message), "libjpeg reads a %ux%u image where the header said %dx%d",
                 (unsigned int)cinfo.output_width, (unsigned int)cinfo.output_height, expected_width,
                 expected_height);
        failed = 2;
        goto done;
    }

    released = PyEval_SaveThread();
    jpeg_start_decompress(&cinfo);
    PyEval_RestoreThread(released);
    released = NULL;
    cinfo_width = cinfo.output_width;
    cinfo_height = cinfo.output_height;
    if ((JDIMENSION)x1 > cinfo.output_width) x1 = (int)cinfo.output_width;
    if ((JDIMENSION)y1 > cinfo.output_height) y1 = (int)cinfo.output_height;
    if (x0 >= x1 || y0 >= y1) {
        strcpy(err.message, "decode_region: the region is outside the image");
        failed = 2;
        goto done;
    }
    xoffset = (JDIMENSION)x0;
    width = (JDIMENSION)(x1 - x0);
    if (xoffset > 0 || width < cinfo.output_width)
        jpeg_crop_scanline(&cinfo, &xoffset, &width); /* sets output_width to the cropped width */
    rows_from = (JDIMENSION)y0;
    rows = (JDIMENSION)(y1 - y0);

    /* Full-size rows: the region lands where it is in the image, so the resize takes the same box (and
     * computes the same filter weights) as on Pillow's full decode. Only the region is written: the
     * rest is never read (the region covers the filter's reach) and its pages are never touched. */
    pixels = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cinfo_width * cinfo_height * 4);
    scratch = (JSAMPROW)PyMem_RawMalloc((size_t)cinfo.output_width * 4);
    if (pixels == NULL || scratch == NULL) {
        failed = 3;
        goto done;
    }
    {
        JSAMPROW row_pointer;
        JSAMPLE *out = (JSAMPLE *)PyBytes_AS_STRING(pixels);
        released = PyEval_SaveThread();
        if (rows_from > 0 && jpeg_skip_scanlines(&cinfo, rows_from) != rows_from) {
            strcpy(err.message, "decode_region: libjpeg skipped fewer rows than asked");
            failed = 2;
            goto done;
        }
        while (cinfo.output_scanline < rows_from + rows) {
            row_pointer = out + ((size_t)cinfo.output_scanline * cinfo_width + xoffset) * 4;
            if (jpeg_read_scanlines(&cinfo, &row_pointer, 1) != 1) {
                strcpy(err.message, "decode_region: libjpeg returned no row");
                failed = 2;
                goto done;
            }
        }
        if (jpeg_input_complete(&cinfo)) {
            /* A multi-scan JPEG: its data was read to the EOI (and any cut seen) by jpeg_start_decompress. */
            jpeg_abort_decompress(&cinfo);
            PyEval_RestoreThread(released);
            released = NULL;
            goto done;
        }
        /* The rows below are entropy-decoded but not transformed; the last one is read, as skipping to
         * the end would stop decoding and hide a cut in the data there. */
        if (cinfo.output_scanline + 1 < cinfo.output_height) {
            JDIMENSION below = cinfo.output_height - 1 - cinfo.output_scanline;
            if (jpeg_skip_scanlines(&cinfo, below) != below) {
                strcpy(err.message, "decode_region: libjpeg skipped fewer rows than asked");
                failed = 2;
                goto done;
            }
        }
        while (cinfo.output_scanline < cinfo.output_height) {
            row_pointer = scratch;
            if (jpeg_read_scanlines(&cinfo, &row_pointer, 1) != 1) {
                strcpy(err.message, "decode_region: libjpeg returned no row");
                failed = 2;
                goto done;
            }
        }
        jpeg_finish_decompress(&cinfo);
        PyEval_RestoreThread(released);
        released = NULL;
    }

done:
    if (released != NULL) { /* error_exit jumped out of a libjpeg call made without the GIL */
        PyEval_RestoreThread(released);
        released = NULL;
    }
    jpeg_destroy_decompress(&cinfo);
    if (scratch != NULL) PyMem_RawFree(scratch);
    PyBuffer_Release(&view);
    if (failed || err.cut) {
        Py_XDECREF(pixels);
        if (failed == 3) return PyErr_NoMemory();
        /* A cut comes first: libjpeg's error after it (an unknown marker in the garbage past a stray one)
         * is about bytes the strict path never delivers. */
        if (err.cut) {
            PyErr_SetString(ScanDataEnded, "the scan data ends before the image does");
            return NULL;
        }
        PyErr_SetString(failed == 2 ? PyExc_ValueError : PyExc_OSError, err.message);
        return NULL;
    }
    return Py_BuildValue("(NIIIIII)", pixels, (unsigned int)cinfo_width, (unsigned int)cinfo_height,
                         (unsigned int)xoffset, (unsigned int)width, (unsigned int)rows_from, (unsigned int)rows);
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, end, scale, W, H, x0, x1, y0, y1) -> (rgbx bytes, W, H, x, width, y, height)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "preprocess.image._jpeg_region", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__jpeg_region(void) {
    PyObject *markers = PyImport_ImportModule("preprocess.image.jpeg_markers");
    if (markers == NULL) return NULL;
    ScanDataEnded = PyObject_GetAttrString(markers, "ScanDataEnded");
    Py_DECREF(markers);
    if (ScanDataEnded == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "LIBJPEG_VERSION", JPEG_LIB_VERSION) < 0) return NULL;
    return m;
}
