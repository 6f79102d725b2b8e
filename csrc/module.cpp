// The Python module pycomm._C. Loading it also runs the static
// registrations in csrc/ops (torch.ops.pycomm.*). It binds the compressed
// backend with torch's own pybind11 (the one torch's c10d types were bound
// with), so the Backend and Work objects cross between torch and pycomm.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include "distributed/backend.hpp"

namespace py = pybind11;
using pycomm::dist::CallerWaits;
using pycomm::dist::CompressedBackend;
using pycomm::dist::ErrorFeedback;

namespace {

py::dict error_feedback_to_dict(const ErrorFeedback& ef) {
  py::dict d;
#define PYCOMM_PUT(field) d[#field] = ef.field;
  PYCOMM_EF_SAVED_FIELDS(PYCOMM_PUT)
#undef PYCOMM_PUT
  d["calls"] = ef.calls;
  return d;
}

ErrorFeedback error_feedback_from_dict(const py::dict& d) {
  ErrorFeedback ef;
#define PYCOMM_GET(field) ef.field = d[#field].cast<decltype(ef.field)>();
  PYCOMM_EF_SAVED_FIELDS(PYCOMM_GET)
#undef PYCOMM_GET
  // States saved before keys counted their calls start the count at 0.
  ef.calls = d.contains("calls") ? d["calls"].cast<int64_t>() : 0;
  return ef;
}

// The C++ side of pycomm/distributed/spec.py, for tests/test_spec.py.
py::dict spec_dict() {
  using namespace pycomm::dist;
  py::dict d;
  py::list methods, fields, rows;
  for (const char* m : kMethods) methods.append(m);
  using namespace pybind11::literals;
  for (const MethodRow& r : kMethodTable)
    rows.append(py::dict("name"_a = r.name, "kind"_a = r.kind, "family"_a = r.family,
                         "bits"_a = r.bits, "block_size"_a = r.block_size, "rounds"_a = r.rounds,
                         "residuals"_a = r.residuals, "error_feedback"_a = r.error_feedback,
                         "dtype"_a = r.dtype, "auto_candidate"_a = r.auto_candidate));
  d["method_table"] = py::tuple(rows);
  for (const char* f : kFieldNames) fields.append(f);
  py::list collectives;
  for (const char* c : kCollectives) collectives.append(c);
  d["collectives"] = py::tuple(collectives);
  d["reduce_scatter_suffix"] = kReduceScatterSuffix;
  d["all_gather_suffix"] = kAllGatherSuffix;
  d["methods"] = py::tuple(methods);
  d["call_fields"] = py::tuple(fields);
  d["default_chunk_numel"] = kDefaultChunkNumel;
  d["tag_words"] = kTagWords;
  d["gather_numel"] = kGatherNumel;
  d["all_reduce_gathers"] = py::cpp_function(
      [](const std::string& m, int64_t n, int world) { return all_reduce_gathers(m, n, world); });
  py::dict blocks;
  for (const char* m : kMethods) {
    if (is_block_method(m)) blocks[m] = default_block_size(m);
  }
  d["default_block_size"] = blocks;
  d["chunk_length"] = py::cpp_function([](int64_t n, int64_t c) { return chunk_length(n, c); });
  d["block_segments"] = py::cpp_function([](int64_t m, int world, int64_t block, int bits) {
    const BlockLayout lay(m, world, block, bits);
    py::list bounds;
    for (int j = 0; j < world; ++j) {
      const int64_t b = std::min(m, j * lay.seg);
      bounds.append(py::make_tuple(b, b + lay.len[j]));
    }
    return py::make_tuple(lay.seg, bounds, lay.size);
  });
  d["rounding_seed"] = py::cpp_function(
      [](int64_t seed, int64_t stream, int64_t call, int collective, int64_t rank, int64_t chunk,
         int64_t part) { return rounding_seed(seed, stream, call, collective, rank, chunk, part); });
  d["topk_wire_numel"] = py::cpp_function(
      [](int64_t m, double density, bool approx) { return topk_wire_numel(m, density, approx); });
  return d;
}

// A Work the caller waits for at once (`wait`), waited for before the
// binding returns, which then returns None: a Work nobody reads would cost
// a small call a Python object made and freed.
std::optional<c10::intrusive_ptr<c10d::Work>> waited(c10::intrusive_ptr<c10d::Work> work,
                                                     bool wait) {
  if (!wait) return work;
  work->wait();
  return std::nullopt;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pycomm's compiled core: ops (torch.ops.pycomm.*) and the compressed backend";
  m.def("spec", &spec_dict, "The engine's copy of pycomm.distributed.spec (for tests).");
  m.def(
      "check_residual_layout",
      [](const std::string& label, const py::dict& residuals, int rank, int64_t block) {
        pycomm::dist::check_residual_layout(label, error_feedback_from_dict(residuals), rank, block);
      },
      py::arg("label"), py::arg("residuals"), py::arg("rank"), py::arg("block"),
      "The engine's check of one key's saved residuals against its layout "
      "(pycomm.distributed.session.check_residual).");
  // Make sure torch's c10d bindings (Backend, Work) are registered first.
  py::module_::import("torch.distributed");

  py::class_<CompressedBackend, c10d::Backend, c10::intrusive_ptr<CompressedBackend>>(
      m, "CompressedBackend",
      "A c10d Backend wrapping `inner` that compresses float SUM/AVG all-reduces.")
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& inner, const std::string& method,
                       int64_t min_compress_numel, int64_t chunk_numel, int64_t block_size,
                       double density, bool approx, int check_calls,
                       const c10::intrusive_ptr<c10d::Backend>& intra,
                       const c10::intrusive_ptr<c10d::Backend>& inter,
                       const std::string& plugin_options, int64_t rounding_seed,
                       const c10::intrusive_ptr<c10d::Backend>& check) {
             pycomm::dist::Config c;
             c.rounding_seed = rounding_seed;
             c.plugin_options = plugin_options;
             c.method = method;
             c.min_compress_numel = min_compress_numel;
             c.chunk_numel = chunk_numel;
             c.block_size = block_size;
             c.density = density;
             c.approx = approx;
             c.check_calls = check_calls;
             return c10::make_intrusive<CompressedBackend>(inner, c, intra, inter, check);
           }),
           py::arg("inner"), py::arg("method"), py::arg("min_compress_numel"),
           py::arg("chunk_numel"), py::arg("block_size"), py::arg("density"), py::arg("approx"),
           py::arg("check_calls") = 1, py::arg("intra") = py::none(), py::arg("inter") = py::none(),
           py::arg("plugin_options") = "{}", py::arg("rounding_seed") = -1,
           py::arg("check") = py::none())
      // `wait`: the caller waits for the Work at once (CallerWaits): the
      // binding waits for it before it returns (its error raised here), one
      // call from Python instead of two.
      .def("allreduce_keyed",
           [](CompressedBackend& b, at::Tensor tensor, std::optional<int64_t> key, bool average,
              std::optional<std::string> method, bool wait) {
             const CallerWaits waits(wait);
             return waited(b.allreduce_keyed(tensor, key, average, method), wait);
           },
           py::arg("tensor"), py::arg("key"), py::arg("average"), py::arg("method") = py::none(),
           py::arg("wait") = false, py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter_keyed",
           [](CompressedBackend& b, at::Tensor output, at::Tensor input,
              std::optional<int64_t> key, bool average, bool wait) {
             const CallerWaits waits(wait);
             return waited(b.reduce_scatter_keyed(output, input, key, average), wait);
           },
           py::arg("output"), py::arg("input"), py::arg("key"), py::arg("average"),
           py::arg("wait") = false, py::call_guard<py::gil_scoped_release>())
      .def("all_gather_keyed",
           [](CompressedBackend& b, at::Tensor output, at::Tensor input,
              std::optional<int64_t> key, bool wait) {
             const CallerWaits waits(wait);
             return waited(b.all_gather_keyed(output, input, key), wait);
           },
           py::arg("output"), py::arg("input"), py::arg("key"), py::arg("wait") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("method_for", &CompressedBackend::method_for, py::arg("numel"))
      .def("set_size_methods", &CompressedBackend::set_size_methods, py::arg("table"),
           py::arg("calibration") = "", py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("ranks_per_node", &CompressedBackend::ranks_per_node)
      .def("allreduce_plain",
           [](CompressedBackend& b, at::Tensor tensor, bool average, bool wait) {
             const CallerWaits waits(wait);
             return waited(b.allreduce_plain(tensor, average), wait);
           },
           py::arg("tensor"), py::arg("average"), py::arg("wait") = false,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("inner", &CompressedBackend::inner)
      .def_property_readonly("config",
                             [](const CompressedBackend& b) {
                               const auto& c = b.config();
                               py::dict d;
#define PYCOMM_PUT(field) d[#field] = c.field;
                               PYCOMM_CONFIG_FIELDS(PYCOMM_PUT)
#undef PYCOMM_PUT
                               d["ranks_per_node"] = b.ranks_per_node();
                               return d;
                             })
      .def("error_feedback_state",
           [](CompressedBackend& b, std::optional<std::vector<int64_t>> keys) {
             std::map<int64_t, ErrorFeedback> state;
             {
               py::gil_scoped_release no_gil;
               state = b.error_feedback_state(std::move(keys));
             }
             py::dict out;
             for (const auto& [key, ef] : state) out[py::int_(key)] = error_feedback_to_dict(ef);
             return out;
           },
           py::arg("keys") = py::none())
      .def(
          "load_error_feedback_state",
          [](CompressedBackend& b, const py::dict& state, bool replace) {
            std::map<int64_t, ErrorFeedback> parsed;
            for (const auto& [key, value] : state)
              parsed.emplace(key.cast<int64_t>(), error_feedback_from_dict(value.cast<py::dict>()));
            py::gil_scoped_release no_gil;
            b.load_error_feedback_state(std::move(parsed), replace);
          },
          py::arg("state"), py::arg("replace") = true)
      .def("undo_error_feedback", &CompressedBackend::undo_error_feedback, py::arg("keys"),
           py::call_guard<py::gil_scoped_release>())
      .def("reset_error_feedback", &CompressedBackend::reset_error_feedback,
           py::arg("key") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("kept_nbytes", &CompressedBackend::kept_nbytes,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "profile",
          [](CompressedBackend& b, bool reset) {
            pycomm::dist::Profile p;
            {
              py::gil_scoped_release no_gil;
              p = b.profile(reset);
            }
            py::dict d;
            d["calls"] = p.calls;
            d["collectives"] = p.collectives;
            d["forwarded"] = p.forwarded;
            d["queued_s"] = p.queued_s;
            d["run_s"] = p.run_s;
            d["check_s"] = p.check_s;
            d["encode_s"] = p.encode_s;
            d["wire_s"] = p.wire_s;
            d["decode_s"] = p.decode_s;
            d["sync_s"] = p.sync_s;
            d["forwarded_s"] = p.forwarded_s;
            return d;
          },
          py::arg("reset") = false);
}
