// A suffix trie bounded by depth, with occurrence counts: the structure behind `--draft suffix`,
// in native code. eyas/engine/speculative/proposers/suffix_trie.py holds the contract, the same
// layout (node ids, the children's order, the free list) and a Python twin that gives the same
// answers; tests/speculative/test_suffix_structures.py compares the two.
//
// The floor it chases: a few hash lookups per token appended (one per kept suffix, at most
// max_depth), where the Python twin spends ~17 us per token at depth 24 (serving 16 requests,
// every row appends every token it emits).

#pragma once

#include <cstdint>
#include <memory>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace eyas {

// One continuation found by SuffixTrie::continuations: its token, the index of its parent in
// the list (-1: a child of the matched node), its depth (1: a child of the matched node), its
// probability of lying on the accepted path and its count ratio to its parent.
using Continuation = std::tuple<int64_t, int64_t, int64_t, double, double>;

class SuffixTrie {
 public:
  explicit SuffixTrie(int64_t max_depth);

  int64_t max_depth() const { return max_depth_; }
  int64_t nodes() const { return nodes_; }
  int64_t count(int64_t node) const;
  int64_t child(int64_t node, int64_t token) const;  // -1: none
  std::vector<std::pair<int64_t, int64_t>> children(int64_t node) const;  // (token, child), newest first
  int64_t bytes() const;  // what the nodes take, estimated from the containers

  void insert(const std::vector<int64_t>& tokens);
  void remove(const std::vector<int64_t>& tokens);  // one earlier insert(tokens)
  // (node, length) of the longest suffix of `context` (at most max_length tokens) that occurs at
  // least min_count times; (0, 0) when none does.
  std::pair<int64_t, int64_t> match(const std::vector<int64_t>& context, int64_t max_length,
                                    int64_t min_count) const;
  // At most `limit` continuations under `node`, best first (parents before children): each
  // node's `max_children` most frequent children (ties: the newer), probability = parent's x
  // count ratio x scales[parent's depth], kept when >= min_probability. suffix_candidates.py's
  // `grow` says what it is for.
  std::vector<Continuation> continuations(int64_t node, int64_t denominator, const std::vector<double>& scales,
                                          int64_t limit, int64_t max_children, double min_probability) const;

  // The child of `node` for `token`, created where missing, its count raised by one.
  int32_t extend(int32_t node, int64_t token);

 private:
  static int64_t key(int64_t node, int64_t token) { return (node << 22) + token; }
  void unlink(int32_t parent, int32_t child);
  void release(int32_t parent, int32_t node);

  int64_t max_depth_;
  int64_t nodes_ = 0;  // live nodes, the root excluded
  std::unordered_map<int64_t, int32_t> edges_;  // node * 2^22 + token -> child
  std::vector<int32_t> tokens_, counts_, first_child_, next_sibling_, free_;
};

// Appends tokens to one sequence of a trie, keeping the nodes of its last max_depth - 1
// suffixes, so that each token costs O(max_depth).
class SuffixAppender {
 public:
  explicit SuffixAppender(std::shared_ptr<SuffixTrie> trie) : trie_(std::move(trie)) {}
  void append(int64_t token);
  void extend(const std::vector<int64_t>& tokens);
  // SuffixTrie::match for the sequence appended so far, read from the kept suffixes (valid
  // while nothing is removed from the trie).
  std::pair<int64_t, int64_t> longest(int64_t max_length, int64_t min_count) const;

 private:
  std::shared_ptr<SuffixTrie> trie_;
  std::vector<int32_t> active_;  // nodes of the current suffixes, longest first
  std::vector<int32_t> grown_;
};

}  // namespace eyas
