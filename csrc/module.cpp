// The Python module pycomm._C. Loading it runs the static registrations in
// csrc/ops (torch.ops.pycomm.*); the module itself exports nothing yet, so
// it needs neither pybind11 nor torch headers (a fast translation unit).
#include <Python.h>

static struct PyModuleDef pycomm_module = {
    PyModuleDef_HEAD_INIT, "_C", "pycomm's compiled ops, registered as torch.ops.pycomm.*", -1,
    nullptr, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&pycomm_module); }
