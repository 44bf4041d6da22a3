// Backend-neutral parts of the device interface: barrier derivation, counters, file
// mapping.
#include "gpu/device.h"

#include <cerrno>
#include <cstring>
#include <sstream>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace lily::gpu {

namespace {

// "buffer #<id> '<label>' bytes [a, b)"; the label is read from the live buffer.
std::string describe(const Buffer& buffer, size_t offset, size_t size) {
  std::ostringstream s;
  s << "buffer #" << buffer.id();
  std::string label = buffer.label();
  if (!label.empty()) s << " '" << label << "'";
  s << " bytes [" << offset << ", " << offset + size << ")";
  return s.str();
}

// label() gives the dispatch's display label; called only to build a message.
template <class Label>
void check_range(const Label& label, const Range& r, const char* what) {
  if (!r.buffer)
    throw UsageError("dispatch '" + label() + "': declared " + what + " range has no buffer");
  if (r.offset > r.buffer->size() || r.size > r.buffer->size() - r.offset) {
    std::ostringstream s;
    s << "dispatch '" << label() << "': declared " << what << " range [" << r.offset << ", "
      << r.offset + r.size << ") exceeds buffer #" << r.buffer->id() << " of "
      << r.buffer->size() << " bytes";
    throw UsageError(s.str());
  }
}

// Metal requires a buffer bound at [[buffer(n)]] to be aligned to the parameter's pointee
// type at its offset; the simulator would fault on a misaligned vector access.
template <class Label>
void check_alignment(const Label& label, const Dispatch& d, const Binding& b) {
  if (b.kind != Binding::Kind::buffer) return;
  BufferParameter p = d.pipeline->buffer_parameter(b.index);
  if (p.alignment <= 1 || b.offset % p.alignment == 0) return;
  std::ostringstream s;
  s << "kernel '" << d.pipeline->name() << "' (dispatch '" << label() << "'): buffer(" << b.index
    << ") is bound at offset " << b.offset << ", which is not a multiple of " << p.alignment
    << ", the required alignment of parameter ";
  if (!p.declaration.empty()) s << "'" << p.declaration << "'";
  else s << b.index;
  throw UsageError(s.str());
}

const std::string& given_label(const Dispatch& d) { return d.label.empty() ? d.pipeline->name() : d.label; }

std::string display(const std::string& label, uint64_t index) {
  return label + " (#" + std::to_string(index) + ")";
}

}  // namespace

StageTracker::Span StageTracker::span(const Range& r) {
  Span s;
  s.buffer_id = r.buffer->id();
  s.offset = r.offset;
  s.size = r.size;
  s.disjoint = r.disjoint;
  return s;
}

StageTracker::Conflict StageTracker::conflict(const Dispatch& d) const {
  Conflict c;
  // The first of d's ranges that overlaps one of the spans [first, first + n).
  // waw: writes against writes, where equal nonzero disjoint tags do not conflict.
  auto overlap = [&](const std::vector<Range>& mine, size_t first, size_t n, bool waw = false) {
    for (const Range& r : mine) {
      const Span x = span(r);
      for (size_t i = first; i < first + n; ++i)
        if (x.overlaps(spans_[i]) && !(waw && x.disjoint && x.disjoint == spans_[i].disjoint)) {
          c.mine = &r;
          c.theirs = spans_[i];
          return true;
        }
    }
    return false;
  };
  for (size_t i = 0; i < used_; ++i) {
    const Entry& e = entries_[i];
    const size_t writes = e.first + e.n_reads;
    if (overlap(d.reads, writes, e.n_writes)) c.kind = "read-after-write";
    else if (overlap(d.writes, e.first, e.n_reads)) c.kind = "write-after-read";
    else if (overlap(d.writes, writes, e.n_writes, true)) c.kind = "write-after-write";
    if (c.kind) {
      c.entry = &e;
      return c;
    }
  }
  return c;
}

void StageTracker::add(const Dispatch& d, uint64_t index) {
  if (used_ == entries_.size()) entries_.emplace_back();
  Entry& e = entries_[used_++];
  e.label = given_label(d);  // reuses the entry's storage from an earlier stage
  e.index = index;
  e.first = spans_.size();
  e.n_reads = d.reads.size();
  e.n_writes = d.writes.size();
  for (const Range& r : d.reads) spans_.push_back(span(r));
  for (const Range& r : d.writes) spans_.push_back(span(r));
}

std::string ComputePass::display_label(const Dispatch& d) const { return display(given_label(d), dispatch_index_); }

void ComputePass::start_stage() {
  tracker_.new_stage();
  if (counters_) counters_->barrier_stages += 1;
}

void ComputePass::dispatch(const Dispatch& d) {
  if (ended_) throw UsageError("dispatch on a compute pass that has ended");
  if (!d.pipeline) throw UsageError("dispatch without a pipeline");
  auto label = [&] { return display_label(d); };
  for (const Range& r : d.reads) check_range(label, r, "read");
  for (const Range& r : d.writes) check_range(label, r, "write");
  for (const Binding& b : d.bindings) check_alignment(label, d, b);
  validate(d);

  if (!any_dispatch_) {
    any_dispatch_ = true;
    start_stage();
  }
  StageTracker::Conflict c = tracker_.conflict(d);
  if (c.entry) {
    if (mode_ == BarrierMode::automatic) {
      encode_barrier();
      start_stage();
    } else {
      // Name both dispatches and the overlapping ranges (theirs lies in mine's buffer).
      std::ostringstream s;
      s << "hazard (" << c.kind << ") without a barrier: dispatch '" << label() << "' "
        << describe(*c.mine->buffer, c.mine->offset, c.mine->size) << " conflicts with dispatch '"
        << display(c.entry->label, c.entry->index) << "' "
        << describe(*c.mine->buffer, c.theirs.offset, c.theirs.size) << " in the same barrier stage";
      throw HazardError(s.str());
    }
  }
  tracker_.add(d, dispatch_index_);
  if (counters_) {
    uint64_t bytes_read = 0, bytes_written = 0;
    for (const Range& r : d.reads) bytes_read += r.size;
    for (const Range& r : d.writes) bytes_written += r.size;
    counters_->dispatches += 1;
    counters_->bytes_read += bytes_read;
    counters_->bytes_written += bytes_written;
    if (log_) {
      DispatchRecord rec;
      rec.label = label();
      rec.pass = static_cast<uint32_t>(counters_->passes);
      rec.stage = static_cast<uint32_t>(counters_->barrier_stages - 1);
      rec.kernel = d.pipeline->name();
      rec.bytes_read = bytes_read;
      rec.bytes_written = bytes_written;
      for (const Range& r : d.reads) rec.reads.emplace_back(r.buffer->label(), r.size);
      for (const Range& r : d.writes) rec.writes.emplace_back(r.buffer->label(), r.size);
      rec.threads = d.threadgroup;
      rec.groups = d.grid_is_threadgroups
                       ? d.grid
                       : Size3{(d.grid.x + d.threadgroup.x - 1) / d.threadgroup.x,
                               (d.grid.y + d.threadgroup.y - 1) / d.threadgroup.y,
                               (d.grid.z + d.threadgroup.z - 1) / d.threadgroup.z};
      for (const Binding& b : d.bindings) {
        if (b.kind == Binding::Kind::threadgroup_memory) rec.threadgroup_memory += b.length;
        if (b.kind == Binding::Kind::bytes) rec.args.emplace_back(b.index, b.bytes);
      }
      counters_->log.push_back(std::move(rec));
    }
  }
  ++dispatch_index_;
  encode_dispatch(d);
}

void ComputePass::barrier() {
  if (ended_) throw UsageError("barrier on a compute pass that has ended");
  if (!any_dispatch_ || tracker_.empty()) return;  // nothing to order against
  encode_barrier();
  start_stage();
}

void ComputePass::end() {
  if (ended_) return;
  ended_ = true;
  if (counters_) counters_->passes += 1;
  encode_end();
}

void CommandBuffer::copy(const Buffer& src, size_t src_offset, const Buffer& dst, size_t dst_offset,
                         size_t size) {
  if (status() != Status::encoding) throw UsageError("copy: the command buffer was already committed");
  auto check = [&](const Buffer& b, size_t offset, const char* what) {
    if (offset > b.size() || size > b.size() - offset)
      throw UsageError(std::string("copy: the ") + what + " range [" + std::to_string(offset) + ", " +
                       std::to_string(offset + size) + ") is outside buffer #" + std::to_string(b.id()) + " '" +
                       b.label() + "' (" + std::to_string(b.size()) + " bytes)");
  };
  check(src, src_offset, "source");
  check(dst, dst_offset, "destination");
  if (src_offset % 4 || dst_offset % 4 || size % 4)
    throw UsageError("copy: offsets (" + std::to_string(src_offset) + ", " + std::to_string(dst_offset) +
                     ") and size (" + std::to_string(size) + ") must be multiples of 4 bytes, as Metal requires");
  if (&src == &dst && src_offset < dst_offset + size && dst_offset < src_offset + size)
    throw UsageError("copy: the source and destination ranges of buffer #" + std::to_string(src.id()) + " overlap");
  if (size) encode_copy(src, src_offset, dst, dst_offset, size);
}

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

BufferPtr Device::map_file(const std::string& path, size_t offset, size_t length) {
  if (offset % page_size())
    throw UsageError("map_file('" + path + "'): offset " + std::to_string(offset) +
                     " is not a multiple of the page size " + std::to_string(page_size()));
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("map_file('" + path + "'): " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    throw Error("map_file('" + path + "'): " + std::strerror(e));
  }
  size_t file_size = static_cast<size_t>(st.st_size);
  if (offset > file_size || (length && length > file_size - offset)) {
    ::close(fd);
    throw UsageError("map_file('" + path + "'): range [" + std::to_string(offset) + ", " +
                     std::to_string(offset + length) + ") exceeds the file size " +
                     std::to_string(file_size));
  }
  if (!length) length = file_size - offset;
  if (!length) {
    ::close(fd);
    throw UsageError("map_file('" + path + "'): empty range");
  }
  // Metal's no-copy buffers need a page-aligned pointer and a page-multiple length.
  size_t mapped = (length + page_size() - 1) / page_size() * page_size();
  void* p = ::mmap(nullptr, mapped, PROT_READ, MAP_PRIVATE, fd, static_cast<off_t>(offset));
  int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw Error("map_file('" + path + "'): mmap: " + std::strerror(e));
  BufferPtr b = new_buffer_no_copy(p, mapped, [p, mapped] { ::munmap(p, mapped); });
  b->set_label(path);
  return b;
}

std::string gpu_family_name(int family) { return "apple" + std::to_string(family); }

bool is_bfloat_tensor_kernel(const std::string& name) {
  // every prefill tensor kernel takes bfloat operands (the GEMMs since nothing is clipped),
  // and so do both probes
  const std::string tail = "_tensor", probe = "tensor_ops_probe";
  return name.compare(0, probe.size(), probe) == 0 ||
         (name.size() > tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0);
}

int parse_gpu_family(const std::string& name) {
  for (int f = 7; f <= 10; ++f)
    if (name == gpu_family_name(f)) return f;
  throw UsageError("gpu_family must be 'apple7', 'apple8', 'apple9' or 'apple10', not '" + name + "'");
}

}  // namespace lily::gpu
